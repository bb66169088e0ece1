"""``kwarm doctor``: what is installed, which activation door would fire, whether the hook
target resolves in the installed vLLM, which upstream warmups it already has, and the
configuration in force. Works on a machine without a GPU."""
from __future__ import annotations

import glob
import importlib.metadata as md
import json
import os
import platform
import site
import sys
import time


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _site_dirs() -> list[str]:
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    return [d for d in dirs + ([user] if user else []) if d and os.path.isdir(d)]


def doors(enabled: bool) -> dict:
    from kwarm_ext.activation import bootstrap_dir

    pth = [p for d in _site_dirs() for p in glob.glob(os.path.join(d, "kwarm-ext.pth"))]
    door = _door_module()
    boot = bootstrap_dir(write=False)
    on_path = boot in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "kwarm"]
    plugins = os.environ.get("VLLM_PLUGINS")
    plugin_allowed = plugins is None or "kwarm" in [p.strip() for p in plugins.split(",")]
    return {
        ".pth": {"installed": bool(pth) and door is not None, "path": pth[0] if pth else None,
                 "would_fire": bool(pth) and door is not None and enabled,
                 "note": ("_kwarm_door is missing: reinstall kwarm" if pth and door is None else
                          "opens at the first import of " + ", ".join(sorted(door.TRIGGERS)) if door else None)},
        "kwarm run (sitecustomize)": {"installed": os.path.isfile(os.path.join(boot, "sitecustomize.py")),
                                      "path": boot, "would_fire": on_path and enabled,
                                      "note": None if on_path else "fires under `kwarm run` only"},
        "vllm.general_plugins": {"installed": bool(eps), "path": eps[0].value if eps else None,
                                 "would_fire": bool(eps) and enabled and plugin_allowed,
                                 "note": None if plugin_allowed else f"VLLM_PLUGINS={plugins!r} excludes kwarm"},
    }


def _door_module():
    """The ``.pth`` line's ``_kwarm_door`` module (it imports nothing), or None where it is missing."""
    try:
        import _kwarm_door
    except ImportError:
        return None
    return _kwarm_door


def hook_target() -> dict:
    from kwarm_ext.patches import (AFTER_CAPTURE_TARGET, BEFORE_LOAD, BEFORE_PROFILE, ENGINE_CONFIG, MODEL_BUILT,
                                   TARGET_ATTRIBUTE, TARGET_MODULE, after_capture_class, is_after_capture_patched,
                                   is_patched)

    out = {"module": TARGET_MODULE, "attribute": TARGET_ATTRIBUTE, "found": False, "patched": False,
           "after_capture": {"attribute": AFTER_CAPTURE_TARGET, "found": False, "patched": False},
           "before_profile": {"attribute": f"{BEFORE_PROFILE.owner}.{BEFORE_PROFILE.attribute}", "found": False,
                              "patched": False},
           "before_load": {"attribute": f"{BEFORE_LOAD.owner}.{BEFORE_LOAD.attribute}", "found": False,
                           "patched": False},
           "model_built": {"attribute": MODEL_BUILT.target, "found": False, "patched": False},
           "engine_config": {"attribute": ENGINE_CONFIG.target, "found": False, "patched": False}}
    t0 = time.perf_counter()
    try:
        import importlib

        module = importlib.import_module(TARGET_MODULE)
        out["found"] = getattr(module, TARGET_ATTRIBUTE, None) is not None
        out["patched"] = is_patched(module)
        out["after_capture"].update(found=after_capture_class(module) is not None,
                                    patched=is_after_capture_patched(module))
        out["before_profile"].update(found=BEFORE_PROFILE.holder(module) is not None,
                                     patched=BEFORE_PROFILE.applied(module))
        out["before_load"].update(found=BEFORE_LOAD.holder(module) is not None, patched=BEFORE_LOAD.applied(module))
        loader = importlib.import_module(MODEL_BUILT.module)
        out["model_built"].update(found=MODEL_BUILT.current(loader) is not None, patched=MODEL_BUILT.applied(loader))
        args = importlib.import_module(ENGINE_CONFIG.module)
        out["engine_config"].update(found=ENGINE_CONFIG.holder(args) is not None, patched=ENGINE_CONFIG.applied(args))
        from kwarm_ext import vllm_compat
        from kwarm_ext.patches import SERVING_THREADS

        # kwarm's wrapper applies vLLM's serving thread count before the warmups (patches.py says why)
        out["after_capture"]["serving_threads"] = vllm_compat.has(SERVING_THREADS)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["import_s"] = round(time.perf_counter() - t0, 2)
    return out


def manifests(settings) -> dict:
    """Where learn-and-replay manifests are, and which exist (nothing is read or imported)."""
    from kwarm_ext.manifest_files import cache_dir

    directory = cache_dir()
    found = sorted(glob.glob(os.path.join(directory, "*.json")))
    folders = glob.glob(os.path.join(directory, "*.cute_dsl"))
    if settings.manifest:
        folders.append(os.path.splitext(settings.manifest)[0] + ".cute_dsl")
    return {"directory": directory, "override": settings.manifest, "found": found,
            "override_exists": bool(settings.manifest) and os.path.isfile(settings.manifest),
            "cute_dsl": {folder: saved_cute_dsl(folder) for folder in sorted(set(folders)) if os.path.isdir(folder)}}


def saved_cute_dsl(folder: str) -> dict:
    """The ``cute_dsl`` family's saved kernels in a deployment's folder: source -> count of ``.o``
    files over its stacks' subfolders (names only, nothing loaded)."""
    counts = {}
    for source in sorted(os.listdir(folder)):
        n = len(glob.glob(os.path.join(folder, source, "*", "*.o")))
        if n:
            counts[source] = n
    return counts


def gpu() -> dict:
    """Whether this machine has a CUDA GPU torch can use (families warm GPU kernels only)."""
    if _version("torch") is None:
        return {"available": False, "why": "torch is not installed"}
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        return {"available": False, "why": f"torch.cuda failed: {type(exc).__name__}: {exc}"}
    if not count:
        return {"available": False, "why": "no CUDA GPU is visible (torch.cuda.is_available() is False)"}
    return {"available": True, "count": count, "name": torch.cuda.get_device_name(0)}


def enabled_text(raw: str | None, enabled: bool) -> str:
    """The doctor's first-line word on KWARM_ENABLE."""
    if enabled:
        return "enabled"
    if raw is None:
        return "disabled (KWARM_ENABLE is not set)"
    from kwarm_ext.config import FALSE

    if raw.strip().lower() in FALSE:
        return f"disabled (KWARM_ENABLE={raw!r})"
    return f"disabled (KWARM_ENABLE={raw!r} is not 1/true/yes/on or 0/false/no/off)"


def collect() -> dict:
    from kwarm_ext import activation, config
    from kwarm_ext._version import __version__
    from kwarm_ext.families import FAMILIES, PROCESS_FAMILIES
    from kwarm_ext.upstream import ATTENTION_BACKENDS, UPSTREAM_WARMUPS, detect

    settings = config.parse()
    vllm = _version("vllm")
    here = gpu()
    report = {
        "kwarm": __version__,
        "enable_text": enabled_text(os.environ.get("KWARM_ENABLE"), settings.enable),
        "gpu": here,
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "triton": _version("triton"), "vllm": _version("vllm"), "wrapt": _version("wrapt")},
        "enabled": settings.enable, "active_in_this_process": activation.is_active(),
        "doors": doors(settings.enable),
        "hook_target": hook_target() if vllm else {"found": False, "error": "vllm is not installed"},
        "upstream_warmups": {} if vllm else {"error": "vllm is not installed: nothing to compare with"},
        "families": {n: {"summary": f.summary, "upstream": f.upstream, "selected": settings.warmups.wants(n),
                         "forced": n in settings.warmups.forced,
                         "here": _applies_here(f, settings, vllm, here)}
                     for n, f in {**FAMILIES, **PROCESS_FAMILIES}.items()},
        "attention_backends": {n: {"runs": runs, "warmed_by": by} for n, (runs, by) in ATTENTION_BACKENDS.items()},
        "config": settings.as_dict(), "config_problems": list(settings.problems),
        "manifests": manifests(settings),
        "flashinfer": flashinfer_jit(),
        "surfaces": jit_surfaces(),
    }
    # the .pth door opens at vLLM's import (hook_target's): whether kwarm is active here, after it
    report["active_in_this_process"] = activation.is_active()
    if vllm:
        try:
            found = detect()
            report["upstream_warmups"] = {n: {"present": found[n], "covers": UPSTREAM_WARMUPS[n][1],
                                              "releases": UPSTREAM_WARMUPS[n][2]} for n in found}
        except Exception as exc:
            report["upstream_warmups"] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


def jit_surfaces() -> dict:
    """The JIT surfaces kwarm counts, learns and replays (kwarm_ext/surfaces/), each with its
    library's installed version (None: not installed, nothing of it to learn)."""
    from kwarm_ext import surfaces

    dists = {"triton": "triton", "flashinfer": "flashinfer-python"}
    return {name: {"label": surfaces.get(name).label, "version": _version(dists.get(name, name))}
            for name in surfaces.NAMES}


def flashinfer_jit(env=None) -> dict:
    """Whether FlashInfer can build the modules it compiles on first use (the wheel ``pip install
    vllm`` brings ships none): its version, and the nvcc and ninja its JIT would run. Imports nothing."""
    import shutil

    env = os.environ if env is None else env
    version = _version("flashinfer-python")
    out = {"version": version, "can_build": False}
    if version is None:
        out["why"] = "not installed: vLLM runs its own kernels instead, and kwarm's flashinfer_jit has nothing to do"
        return out
    if env.get("FLASHINFER_DISABLE_JIT"):
        out["why"] = "FLASHINFER_DISABLE_JIT is set: only modules already in its cache load"
        return out
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = env.get("FLASHINFER_NVCC") or os.path.join(home, "bin", "nvcc")
    out.update(nvcc=nvcc if os.path.exists(nvcc) else None, ninja=shutil.which("ninja", path=env.get("PATH")))
    missing = [name for name in ("nvcc", "ninja") if not out[name]]
    if missing:
        out["why"] = (f"no {' or '.join(missing)} (nvcc looked for at {nvcc}; set CUDA_HOME): a module not yet in "
                      "FlashInfer's cache fails to build, and the request or warmup step that needs it fails")
    else:
        out["can_build"] = True
    return out


def _applies_here(family, settings, vllm: str | None, here: dict) -> str:
    """Whether `family` would run on this machine, and if not, why."""
    if not settings.warmups.wants(family.name):
        return "no: disabled by KWARM_WARMUPS"
    if not settings.enable:
        return "no: kwarm is disabled (KWARM_ENABLE)"
    if family.process != "worker":
        return f"in vLLM's {family.process} process" if vllm else "no: vllm is not installed"
    if not vllm:
        return "no: vllm is not installed"
    if not here["available"]:
        return f"no: {here['why']}"
    return "yes, where the engine's model has what it warms"


def verdict(r: dict) -> list:
    """The first lines: whether kwarm would act here, on which families, and why not on the others."""
    h, g = r["hook_target"], r["gpu"]
    hook = (f"found (patched={'yes' if h.get('patched') else 'no'})" if h.get("found")
            else f"not found ({h.get('error') or 'unknown'})")
    runs = [n for n, f in r["families"].items() if f["here"].startswith("yes")]
    elsewhere = [n for n, f in r["families"].items() if f["here"].startswith("in vLLM's")]
    reasons: dict = {}
    for n, f in r["families"].items():
        if f["here"].startswith("no"):
            reasons.setdefault(f["here"][4:], []).append(n)
    lines = [f"  worker hook: {hook}; GPU: {g['name'] + ' x ' + str(g['count']) if g['available'] else 'none'}",
             f"  families that run here: {', '.join(runs) or 'none'}"
             + (f"; in vLLM's other processes: {', '.join(elsewhere)}" if elsewhere else "")]
    lines += [f"  not here ({why}): {', '.join(names)}" for why, names in reasons.items()]
    # KWARM_ENABLE's problem is the verdict's first line already (each problem said once)
    said = "KWARM_ENABLE=" in r["enable_text"]
    lines += [f"  problem: {p}" for p in r["config_problems"] if not (said and p.startswith("KWARM_ENABLE="))]
    return lines


def render(r: dict) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    lines = [f"kwarm {r['kwarm']}: {r['enable_text']}", *verdict(r), "", "versions:"]
    lines += [f"  {k:8s} {v or 'not installed'}" for k, v in r["versions"].items()]
    g = r["gpu"]
    lines += ["", f"GPU: {g['name']} x {g['count']}" if g["available"] else
              f"GPU: none ({g['why']}): kwarm's warmups run on CUDA GPUs only"]
    lines += ["", "activation doors:"]
    for name, d in r["doors"].items():
        note = f"  ({d['note']})" if d.get("note") else ""
        lines.append(f"  {name:28s} installed={yes(d['installed'])} would_fire={yes(d['would_fire'])}{note}")
    h = r["hook_target"]
    if h.get("module") is None:
        lines += ["", f"hook target: unknown ({h.get('error')}; kwarm hooks vLLM's worker warmup)"]
    else:
        lines += ["", f"hook target: {h.get('module')}.{h.get('attribute')} found={yes(h.get('found'))} "
                      f"patched={yes(h.get('patched'))}" + (f"  error: {h['error']}" if h.get("error") else "")]
    if h.get("before_profile"):
        b = h["before_profile"]
        lines.append(f"before-profile target: {h.get('module')}.{b['attribute']} found={yes(b['found'])} "
                     f"patched={yes(b['patched'])}  (kwarm's ahead families, deep_gemm, before vLLM's profile run)")
    if h.get("before_load"):
        b = h["before_load"]
        lines.append(f"before-load target: {h.get('module')}.{b['attribute']} found={yes(b['found'])} "
                     f"patched={yes(b['patched'])}  (deep_gemm's compile processes start beside weight loading)")
    if h.get("model_built"):
        b = h["model_built"]
        lines.append(f"model-built target: {b['attribute']} found={yes(b['found'])} patched={yes(b['patched'])}  "
                     "(deep_gemm's compiles run while the weights load)")
    if h.get("after_capture"):
        a = h["after_capture"]
        lines.append(f"after-capture target: {h.get('module')}.{a['attribute']} found={yes(a['found'])} "
                     f"patched={yes(a['patched'])}")
        if "serving_threads" in a:
            lines.append("  serving thread count: " + (
                "vLLM sets it (set_torch_threads_for_runtime); kwarm applies it before vLLM's warmups"
                if a["serving_threads"] else "vLLM keeps start-up's torch thread count: nothing to do"))
    lines += ["", "upstream warmups in this vLLM:"]
    for name, u in r["upstream_warmups"].items():
        if name == "error":
            lines.append(f"  ({u})")
        elif isinstance(u, dict):
            lines.append(f"  {name:26s} {'present' if u['present'] else 'absent ':8s} {u['covers']} [{u['releases']}]")
        else:
            lines.append(f"  {name}: {u}")
    fi = r.get("flashinfer") or {}
    if fi:
        lines += ["", f"FlashInfer: {fi.get('version') or 'not installed'}: " + (
            f"builds its JIT modules with {fi['nvcc']} and {fi['ninja']}" if fi.get("can_build") else fi.get("why", ""))]
    lines += ["", "JIT surfaces (counted, learned with KWARM_LEARN, replayed at the next start):"]
    for name, surface in (r.get("surfaces") or {}).items():
        lines.append(f"  {name:11s} {surface['label']}: " + (surface["version"] or "not installed, nothing to learn"))
    lines += ["", "attention backends (what a request runs, and what warms it):"]
    for name, b in r.get("attention_backends", {}).items():
        lines.append(f"  {name:21s} {b['runs']}: {b['warmed_by']}")
    lines += ["", "families:"]
    width = max(map(len, r["families"]), default=0)
    for name, f in r["families"].items():
        state = "forced" if f["forced"] else ("selected" if f["selected"] else "disabled")
        lines.append(f"  {name:{width}s} {state:9s} {f['summary']}")
        lines.append(f"  {'':{width}s} {'':9s} upstream: {f['upstream']}")
        lines.append(f"  {'':{width}s} {'':9s} runs here: {f['here']}")
    m = r.get("manifests") or {}
    lines += ["", "learn-and-replay manifests:"]
    if m.get("override"):
        lines.append(f"  KWARM_MANIFEST {m['override']} ({'exists' if m['override_exists'] else 'absent'})")
    lines.append(f"  {m.get('directory')}: {len(m.get('found', []))} manifests")
    lines += [f"    {os.path.basename(path)}" for path in m.get("found", [])[:20]]
    saved = m.get("cute_dsl") or {}
    if saved:
        lines.append(f"  saved CuTe DSL kernels (cute_dsl family), {len(saved)} deployments:")
        lines += [f"    {os.path.basename(folder)}: " + (", ".join(f"{source} {n}" for source, n in counts.items()) or "none")
                  for folder, counts in list(saved.items())[:20]]
    lines += ["", "configuration:"] + [f"  {k:21s} {v}" for k, v in r["config"].items()]
    if r["config_problems"]:  # each problem is said once, in the verdict at the top
        lines.append(f"  ({len(r['config_problems'])} problem(s): see the top)")
    from kwarm_ext.escape import printable

    # file names (manifests found in a shared cache folder) and paths reach the terminal escaped (issue 59)
    return "\n".join(printable(line, 4000) for line in lines)


# Exit statuses of `kwarm doctor` (README, "kwarm doctor"): bits, so both can be read from one.
OK, INVALID_SETTING, WOULD_NOT_HOOK = 0, 1, 4


def exit_status(r: dict) -> int:
    """0: every setting valid and kwarm would hook this vLLM; +1: a KWARM_* setting is invalid
    (KWARM_ENABLE not a boolean included); +4: kwarm would not hook vLLM here (disabled, vLLM not
    installed, its hook target not found, or no activation door would fire). 2 stays argparse's
    usage error."""
    status = OK
    raw = os.environ.get("KWARM_ENABLE")
    if r["config_problems"] or (raw is not None and not r["enabled"] and "is not 1/true" in r["enable_text"]):
        status |= INVALID_SETTING
    hook = r["hook_target"]
    fires = any(d.get("would_fire") for d in r["doors"].values())
    if not r["enabled"] or not r["versions"].get("vllm") or not hook.get("found") or hook.get("error") or not fires:
        status |= WOULD_NOT_HOOK
    return status


def main(as_json: bool = False) -> int:
    """Print the report on stdout, and only the report (with `as_json`, the JSON alone):
    whatever importing vLLM and torch prints (vLLM's log lines) goes to stderr. Returns
    :func:`exit_status`."""
    import contextlib

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)  # C-level writes and handlers bound to fd 1 during the collection
        with contextlib.redirect_stdout(sys.stderr):  # handlers bound to sys.stdout (vLLM's)
            report = collect()
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(report, indent=1, default=str) if as_json else render(report))
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
