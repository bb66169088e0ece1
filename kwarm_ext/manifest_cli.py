"""``kwarm manifest show|verify|merge PATH...``: read, check and combine learn-and-replay manifests.

- ``show``: the stamp, then one block per kernel: its entries (argument types, constants,
  launch options) and autotune choices.
- ``verify``: each manifest against this installation: the Triton version and GPU
  architecture (when a GPU driver is active), then every entry as replay would check it
  (allowed module, importable kernel, unchanged source, no refused option, readable
  constants). Imports the kernels' modules (allowed ones only). Exit 0 when all is usable.
- ``merge -o OUT``: manifests of several ranks or hosts into OUT (merged into OUT if it
  exists), refusing inputs stamped for another Triton or GPU architecture.

Exit status: 0 all good, 1 some entries or inputs unusable, 2 no usable input.
"""
from __future__ import annotations

import json

from kwarm_ext import manifest, manifest_files, surfaces
from kwarm_ext.manifest import BadManifest, Entry

QUIET_OPTIONS = {"debug": False, "instrumentation_mode": ""}  # the defaults every key carries


def main(action: str, paths: list, output: str | None = None) -> int:
    if action == "show":
        return show(paths)
    if action == "verify":
        return verify(paths)
    return merge(paths, output)


def _load(path: str):
    """(Manifest, None) or (None, why) for one input."""
    try:
        return manifest_files.load(path), None
    except FileNotFoundError:
        return None, "no such file"
    except BadManifest as exc:
        return None, str(exc)


def _each_loaded(paths: list, handle) -> int:
    """``handle(path, manifest)`` for every loadable path (an exit code); an unloadable path
    is one line and code 2. Returns the worst code."""
    worst = 0
    for path in paths:
        data, why = _load(path)
        if data is None:
            print(f"{manifest.printable(path)}: unusable: {manifest.printable(why)}")
            worst = 2
        else:
            worst = max(worst, handle(path, data))
    return worst


def show(paths: list) -> int:
    def one(path, data):
        print(render(path, data))
        return 1 if data.problems else 0

    return _each_loaded(paths, one)


LINE_LIMIT = 2000


def _out(text: str = "") -> None:
    """Print `text` line by line, each escaped (:func:`manifest.printable`): module names, kernel
    names, labels and reasons come from the file, and no byte of it reaches the terminal raw."""
    for line in str(text).split("\n"):
        print(manifest.printable(line, LINE_LIMIT))


def render(path: str, data) -> str:
    s, safe = data.stamp, manifest.printable
    lines = [f"{safe(path)}", f"  stamp: triton {safe(s.triton)}, {safe(s.arch)}, torch {safe(s.torch)}, "
                              f"vllm {safe(s.vllm)}, tp {s.tp_size}, model {safe(s.model)}",
             f"  {len(data.entries)} entries, {len(data.autotune)} autotune choices, "
             f"{len(data.kernels())} kernels, {len(data.token_counts)} learned step sizes"
             + (f" ({_ranges(sorted(data.token_counts))})" if data.token_counts else "")]
    for kernel, group in data.kernels().items():
        first = (group["entries"] or group["autotune"])[0]
        lines.append(f"  {kernel}  (source {first.source_key[:10]}): {len(group['entries'])} entries"
                     + (f", {len(group['autotune'])} autotune choices" if group["autotune"] else ""))
        lines += [f"    {manifest.short_hash(e.key)}  {describe_entry(e)}" for e in group["entries"]]
        lines += [f"    autotune {tuple(c.key)} -> {_describe_config(c.config)}" for c in group["autotune"]]
    for name, section in sorted(data.surfaces.items()):
        surface = surfaces.get(name)
        lines.append(f"  {surface.label} (version {safe(section['version'])}): {len(section['items'])}")
        lines += [f"    {surface.describe(item)}" for item in section["items"]]
    lines += [f"  dropped {label}: {reason}" for label, reason in data.problems]
    if data.more_problems:
        lines.append(f"  dropped {data.more_problems} more malformed items (not listed)")
    return "\n".join(manifest.printable(line, LINE_LIMIT) for line in lines)


def _ranges(values: list, limit: int = 12) -> str:
    """``1-64, 96, 128-130``: sorted ints as runs, at most `limit` runs shown."""
    runs: list = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:limit])
    return text + (f", ... ({len(runs) - limit} more runs)" if len(runs) > limit else "")


def describe_entry(entry: Entry) -> str:
    """``x:*fp16%16 n:i32 BLOCK=128 | num_warps=4``: argument types (``%16``: divisible by 16 or
    16-byte aligned), constants, launch options."""
    spec = entry.spec
    constants = {tuple(p): v for p, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(p): v for p, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    args = []
    for index, (name, kind) in enumerate(spec["signature"].items()):
        if (index,) in constants:
            args.append(f"{name}={_constant(constants[(index,)])}")
            continue
        divisible = "".join(f"%{a[1]}" for a in attrs.get((index,), []) if isinstance(a, list) and len(a) == 2
                            and a[0] == "tt.divisibility")
        args.append(f"{name}:{kind if isinstance(kind, str) else json.dumps(kind)}{divisible}")
    options = [f"{k}={v}" for k, v in entry.launch_options.items() if QUIET_OPTIONS.get(k, object()) != v]
    return " ".join(args) + (" | " + " ".join(options) if options else "")


def _constant(value) -> str:
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        return f"{inner}" if tag in ("constexpr", "tl_dtype", "str") else f"{tag}:{json.dumps(inner)}"
    return json.dumps(value)


def _describe_config(config: dict) -> str:
    parts = [f"{k}={v}" for k, v in config["kwargs"].items()]
    parts += [f"{k}={config[k]}" for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
              if config.get(k) is not None]
    return " ".join(parts)


def verify(paths: list) -> int:
    from kwarm_ext import config
    from kwarm_ext.surfaces.triton import replay

    current = manifest_files.current_stamp()  # None without a GPU driver

    def one(path, data):
        fatal, notes = _stamp_check(data.stamp, current)
        problems = list(data.problems)
        resolver = replay.Resolver(config.get().allowed_modules)
        for entry in data.entries:
            problems += _entry_problems(entry, resolver)
        for choice in data.autotune:
            problems += _choice_problems(choice, resolver)
        problems += _surface_problems(data)
        total = len(data.entries) + len(data.autotune) + data.surface_items()
        usable = 0 if fatal else total - len(problems) + len(data.problems)
        _out(f"{path}: {usable} of {total} items usable here" + (f" ({fatal})" if fatal else ""))
        for note in notes:
            _out(f"  note: {note}")
        for label, reason in problems:
            _out(f"  {label}: {reason}")
        return 1 if fatal or problems else 0

    return _each_loaded(paths, one)


def _surface_problems(data) -> list:
    """The other surfaces' items recorded with another version of their library than this one's,
    and those replay would refuse here (a FlashInfer getter that is no JIT getter of this
    FlashInfer's own modules: ``Surface.problem``, which imports nothing)."""
    out = []
    for name, section in data.surfaces.items():
        surface = surfaces.get(name)
        here = surface.version()
        if section["version"] != here:
            why = f"recorded with {name} {section['version']}, this is {here or f'no {name}'}"
            out += [(surface.describe(item), why) for item in section["items"]]
            continue
        for item in section["items"]:
            why = surface.problem(item)
            if why:
                out.append((surface.describe(item), why))
    return out


def _stamp_check(stamp, current) -> tuple:
    """(why the manifest cannot be used here or None, informational notes)."""
    from kwarm_ext.surfaces.triton import compat as triton_compat

    if current is not None:
        return stamp.incompatibility(current), [f"recorded with {d}" for d in stamp.differences(current)]
    triton = triton_compat.triton_version()
    fatal = None if triton == stamp.triton else f"recorded with Triton {stamp.triton}, this is Triton {triton}"
    return fatal, [f"GPU architecture {stamp.arch} not checked: no GPU driver is active"]


def _entry_problems(entry, resolver) -> list:
    from kwarm_ext.surfaces.triton import replay
    from kwarm_ext.surfaces.triton import preload as triton_preload

    kernel, why = replay.check_entry(entry, resolver)
    if why:
        return [(entry.label, why[1])]
    try:
        triton_preload.preload_job(entry.label, kernel, entry.key, entry.spec, entry.launch_options,
                                  resolver.function_for(entry.key))
    except (TypeError, ValueError, KeyError) as exc:
        return [(entry.label, f"unusable constants: {exc}")]
    return []


def _choice_problems(choice, resolver) -> list:
    from kwarm_ext.surfaces.triton import replay
    from kwarm_ext.surfaces.triton import compat as triton_compat

    kernel, why = replay.check_kernel(choice, resolver)
    if why:
        return [(choice.label, why[1])]
    _, why = triton_compat.find_config(kernel, choice.config)
    return [(choice.label, why)] if why else []


def _sections(data) -> dict:
    return {name: (section["version"], section["items"]) for name, section in data.surfaces.items()}


def merge(paths: list, output: str) -> int:
    inputs, refused, dropped = [], [], []
    for path in paths:
        data, why = _load(path)
        if data is None:
            refused.append((path, why))
        elif inputs and data.stamp.incompatibility(inputs[0].stamp):
            refused.append((path, data.stamp.incompatibility(inputs[0].stamp)))
        else:
            inputs.append(data)
            dropped += [(path, label, reason) for label, reason in data.problems]
            if data.more_problems:
                dropped.append((path, f"{data.more_problems} more malformed items", "not listed"))
    for path, why in refused:
        _out(f"{path}: not merged: {why}")
    for path, label, reason in dropped:
        _out(f"{path}: dropped {label}: {reason}")
    if not inputs:
        print("kwarm manifest merge: no usable input")
        return 2
    combined = manifest.Manifest(inputs[0].stamp)
    for data in inputs:  # in order: a surface's items of another library version replace earlier ones
        combined.merge(data.entries, data.autotune, data.token_counts, _sections(data))
    try:
        result = manifest_files.save(output, combined.stamp, combined.entries, combined.autotune,
                                     combined.token_counts, _sections(combined))
    except (BadManifest, OSError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"kwarm manifest merge: cannot write {manifest.printable(output)}: {manifest.printable(why)}")
        return 2
    if result.note:
        _out(f"{output}: {result.note}")
    left_out = list(dict.fromkeys(combined.left_out + list(result.left_out)))
    for line in left_out:
        _out(f"{output}: {line}")
    _out(f"merged {len(inputs)} manifests into {result.path}: {result.total} items "
         f"({result.added - result.new_step_sizes} new), {result.step_sizes} step sizes ({result.new_step_sizes} new)")
    return 1 if refused or left_out else 0
