#!/usr/bin/env python3
"""Engine benchmark: first-request Triton JIT in a real vLLM engine, with or without kwarm.

    python bench/engine_bench.py bench/models/tiny-qwen3-next --kwarm on --attention-backend TRITON_ATTN
    python bench/engine_bench.py bench/models/tiny-deepseek-v32 --kwarm off --scenario smoke

Starts ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so Triton's
compile hook sees the worker's compiles) on a tiny random-weight model, sends a fixed
scenario of ``generate`` calls and records, per request: wall time, the Triton
compilations during it (kernel and key) and new DeepGEMM JIT cache entries. Also engine
init seconds, the Triton compiles during init, and kwarm's warmup from its KWARM_REPORT
(total and seconds per family), and the first-request excess (sum over (first, repeat)
pairs of first s - repeat s). Writes one JSON file (schema in bench/README.md) and prints
the table (bench/table.py). Scenarios: ``default`` (12 requests), ``smoke`` (gpu-baseline's
5), ``pairs`` (16: every shape immediately followed by its repeat). Needs a CUDA GPU: without
one it exits with one line before building the engine.

Caches (``--triton-cache``):
- ``fresh`` (default): a new empty temp dir as TRITON_CACHE_DIR. Unless you set them,
  VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR get fresh dirs next to it too: vLLM's
  torch.compile cache lives there, and vLLM's Inductor adaptor *re-points*
  TRITON_CACHE_DIR into VLLM_CACHE_ROOT/torch_compile_cache/... during init, so the
  Triton kernels compiled after that land under VLLM_CACHE_ROOT. The dirs are kept; the
  script prints the command that starts again on them (a warm run).
- ``reuse``: keep the environment's caches as they are.
- ``<dir>``: TRITON_CACHE_DIR=<dir>; for a warm rerun give it the VLLM_CACHE_ROOT of the
  first run too.
The result says ``cold`` when the Triton cache and VLLM_CACHE_ROOT were empty at start,
else ``warm``.

``--profile 0,5`` runs those requests under cProfile (top functions in the result, raw
stats in ``<out stem>.req<i>.prof``). ``--sync-lock FILE`` makes engines that share one GPU
take turns: a shared flock on FILE during init, an exclusive one while measuring.

Only argument parsing and the scenario live at module level: vLLM, torch and Triton are
imported inside :func:`main`, after the environment is set.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import fcntl
import functools
import gc
import json
import os
import pstats
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import table  # noqa: E402  (bench/table.py, standard library only)

GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
OPTIONAL_ENGINE_ARGS = ("jit_monitor_verbose",)  # dropped when this vLLM's EngineArgs lacks them


# ------------------------------------------------------------------------- scenario

@dataclasses.dataclass(frozen=True)
class Request:
    """One measured call. `mixed`: (batch, len) prompts added once this request's own
    prompts are decoding, so that one engine step holds decodes and a prefill."""

    label: str
    batch: int
    length: int
    max_tokens: int = 16
    repeat_of: int | None = None
    seed: int = 0
    mixed: tuple[int, int] | None = None
    control_of: int | None = None  # runs request `control_of`'s shape again, after the others
    pause_s: float = 0.0  # idle before it, outside its timing (as request 0 waits after init)


def prompt_ids(batch: int, length: int, seed: int) -> list[dict]:
    """`batch` token-id prompts of `length` tokens (ids 10..4009, inside both vocabularies).

    seed 0 gives exactly smoke.py's prompts. The default scenario gives every request its
    own seed, so a repeat has the same shapes but different tokens and no prefix-cache hit
    (a hit would make the repeat a shorter, different computation).
    """
    return [{"prompt_token_ids": [(7 * j + 3 * k + 131 * seed) % 4000 + 10 for k in range(length)]}
            for j in range(batch)]


def build_scenario(name: str, repeats: int = 1) -> list[Request]:
    """`name`'s requests; `repeats` (pairs only): how many repeats follow each first request."""
    if repeats < 1:
        raise ValueError(f"--repeats is at least 1, got {repeats}")
    if repeats != 1 and name != "pairs":
        raise ValueError(f"--repeats {repeats} needs --scenario pairs")
    if name == "smoke":
        # gpu-baseline.md's five requests, same prompts as gpu-kit/smoke.py (the repeats are
        # identical prompts there, so they may hit the prefix cache; kept for comparability).
        return [Request("1x200", 1, 200), Request("1x200 (repeat)", 1, 200, repeat_of=0),
                Request("4x333", 4, 333), Request("4x333 (repeat)", 4, 333, repeat_of=2),
                Request("1x37", 1, 37)]
    if name == "default":
        return [
            # single prefills over the integer classes Triton specializes on (%16, ==1, other)
            Request("prefill 1x200", 1, 200, seed=1),
            Request("prefill 1x200 (repeat)", 1, 200, repeat_of=0, seed=2),
            Request("prefill 1x37", 1, 37, seed=3),
            Request("prefill 1x16", 1, 16, seed=4),
            Request("prefill 1x1", 1, 1, seed=5),
            # batched prefill
            Request("prefill 4x333", 4, 333, seed=6),
            Request("prefill 4x333 (repeat)", 4, 333, repeat_of=5, seed=7),
            # decode-heavy: 63 decode steps at batch 8, then at batch 3 (another graph size)
            Request("decode 8x8 +64", 8, 8, max_tokens=64, seed=8),
            Request("decode 8x8 +64 (repeat)", 8, 8, max_tokens=64, repeat_of=7, seed=9),
            Request("decode 3x5 +64", 3, 5, max_tokens=64, seed=10),
            # one step with 2 decodes + a 2x300 prefill (see run_mixed)
            Request("mixed 2x8 decoding + 2x300 prefill", 2, 8, max_tokens=64, seed=11, mixed=(2, 300)),
            Request("mixed 2x8 decoding + 2x300 prefill (repeat)", 2, 8, max_tokens=64,
                    repeat_of=10, seed=12, mixed=(2, 300)),
        ]
    if name == "pairs":
        # every shape immediately followed by its repeat (own token ids each): with one repeat
        # request 2k+1 repeats 2k, so every first request has a same-shape baseline for its
        # excess. More repeats make that baseline their median and measure the spread of one
        # request's time, against which a first request's excess is read (table.excess_noise_s).
        firsts = [
            Request("prefill 1x200", 1, 200),
            Request("prefill 1x37", 1, 37),
            Request("prefill 1x1", 1, 1),
            Request("prefill 4x333", 4, 333),
            Request("prefill 1x2500", 1, 2500),
            Request("decode 8x8 +64", 8, 8, max_tokens=64),
            Request("decode 3x5 +64", 3, 5, max_tokens=64),
            Request("mixed 2x8 decoding + 2x300 prefill", 2, 8, max_tokens=64, mixed=(2, 300)),
        ]
        out = []
        for first in firsts:
            i = len(out)
            out.append(dataclasses.replace(first, seed=i + 1))
            out += [dataclasses.replace(first, label=first.label + (f" (repeat {k + 1})" if repeats > 1 else " (repeat)"),
                                        repeat_of=i, seed=i + 2 + k) for k in range(repeats)]
        # the control: request 0's shape once more, last, after a pause. As slow as request 0
        # against its repeat, the excess comes from running after other work, which no warmup
        # removes; as fast as the repeat, it is a first-time cost.
        out.append(dataclasses.replace(firsts[0], label=firsts[0].label + " (control: last, after 2 s)",
                                       seed=len(out) + 2, control_of=0, pause_s=CONTROL_PAUSE_S))
        return out
    if name == "mla-splits":
        # TRITON_MLA's decode splits each KV sequence into the next power of two of
        # max_seq_len // 512 parts (NUM_KV_SPLITS, a constexpr): a new one when the longest
        # context reaches 1024, 1536, 2560 (then 4608, past the default max_model_len 4096).
        # Each decode starts 32 tokens short of one of them and crosses it mid-generation,
        # followed by its repeat; the first pair stays at one split.
        out = []
        for crosses in (None, 1024, 1536, 2560):
            length = 200 if crosses is None else crosses - 32
            first = Request(f"decode 1x{length} +64" + (f" (context crosses {crosses})" if crosses else ""),
                            1, length, max_tokens=64, seed=len(out) + 1)
            out += [first, dataclasses.replace(first, label=first.label + " (repeat)", repeat_of=len(out),
                                               seed=len(out) + 2)]
        return out
    raise ValueError(f"unknown scenario {name!r}")


SCENARIOS = ("default", "smoke", "pairs", "mla-splits")
CONTROL_PAUSE_S = 2.0


# ------------------------------------------------------------------------ arguments

def parse_bytes(text: str | None) -> int | None:
    """'4G' -> 4 GiB; '512M'; plain integers are bytes."""
    if text is None or text == "":
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_indices(text: str | None) -> list[int]:
    """'0,3' -> [0, 3] (sorted, no duplicates); '' or None -> []."""
    if text is None or not text.strip():
        return []
    try:
        found = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected request indices like 0,3, got {text!r}") from None
    if any(i < 0 for i in found):
        raise argparse.ArgumentTypeError(f"request indices are >= 0, got {text!r}")
    return sorted(found)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model config folder (or a name under bench/models/)")
    p.add_argument("--kwarm", choices=("on", "off"), default="on")
    p.add_argument("--scenario", choices=SCENARIOS, default="default")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="pairs scenario: N repeats after each first request (default 1); with N >= 2 "
                        "the steady time is their median and the excess gets a noise estimate")
    p.add_argument("--triton-cache", default="fresh", metavar="fresh|reuse|DIR")
    p.add_argument("--variant", default="",
                   help="free label shown next to kwarm's mode in the table (e.g. 'learn', 'replay')")
    p.add_argument("--out", help="result JSON (default bench/results/<model>-vllm<ver>-kwarm<on|off>-<cold|warm>.json)")
    p.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN (default: vLLM's choice)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cudagraph", choices=("on", "off"), default="on",
                   help="off: compilation_config={'cudagraph_mode': 'NONE'}")
    p.add_argument("--gdn-prefill-backend", default="triton",
                   help="additional_config gdn_prefill_backend for GDN models; 'default' leaves vLLM's")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's max_num_batched_tokens (default: vLLM's, 16384 for LLM on an H200; "
                        "`vllm serve` uses 8192); it bounds the token counts vLLM's DeepGEMM warmup runs")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="TP > 1 runs workers in their own processes: kwarm's per-rank reports are read "
                        "(kwarm_warmup_s_ranks), but Triton compiles there are not counted per request")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory-bytes", default=None,
                   help="e.g. 4G: fixed KV cache size, skips vLLM's memory accounting (needed when "
                        "several engines start on one GPU at once)")
    p.add_argument("--profile", type=parse_indices, default=[], metavar="I,J,...",
                   help="run these requests (indices) under cProfile: top functions in the result, "
                        "raw stats in <out stem>.req<i>.prof; their wall time includes the profiler's overhead")
    p.add_argument("--cuda-profile", type=parse_indices, default=[], metavar="I,J,...",
                   help="run these requests under torch.profiler (CPU and CUDA): the CUDA runtime and "
                        "driver calls that took longest (graph launches, module loads, cudaMalloc) and "
                        "the GPU kernel time go into the result; their wall time includes the overhead")
    p.add_argument("--alloc-stacks", type=parse_indices, default=[], metavar="I,J,...",
                   help="record the CUDA caching allocator's history over these requests: each segment "
                        "they started (cudaMalloc), with its size, stream and the Python frames that asked "
                        "for it (alloc_stacks); their wall time includes recording each allocation, not "
                        "the snapshot taken after the clock stops")
    p.add_argument("--sync-lock", default=None, metavar="FILE",
                   help="flock(2) FILE: shared while the engine initializes, exclusive while it measures "
                        "requests, so that engines sharing a GPU never measure while another one "
                        "initializes or measures")
    p.add_argument("--deepgemm-sweep", action="store_true",
                   help="after the requests, run vLLM's fp8_gemm_nt at every token count up to "
                        "max_num_batched_tokens on each block-FP8 weight vLLM may run on DeepGEMM, and "
                        "record the kernels that still compiled (deepgemm_sweep; needs --max-num-batched-tokens)")
    p.add_argument("--settle-s", type=float, default=0.0, metavar="S",
                   help="sleep S seconds before request 0 (after taking the --sync-lock): lets the "
                        "engine's own start-up threads and another engine's exit finish, as a served "
                        "engine's first request rarely arrives the moment it is ready")
    args = p.parse_args(argv)
    if args.deepgemm_sweep and not args.max_num_batched_tokens:
        p.error("--deepgemm-sweep needs --max-num-batched-tokens (the counts it sweeps)")
    return args


def resolve_model(arg: str) -> Path:
    path = Path(arg)
    if not path.is_dir() and (HERE / "models" / arg).is_dir():
        path = HERE / "models" / arg
    if not (path / "config.json").is_file():
        raise SystemExit(f"engine_bench: {arg}: no config.json there")
    return path.resolve()


def is_gdn_model(cfg: dict) -> bool:
    return cfg.get("model_type") in GDN_MODEL_TYPES or "linear_conv_kernel_dim" in cfg


def rank_warmups(report_path: str | None, ranks: int) -> dict | None:
    """{rank: kwarm warmup seconds} from each rank's report (rank r > 0 at ``<path>.rank<r>``),
    for tensor-parallel runs; None for one rank or without a report."""
    if not report_path or ranks <= 1:
        return None
    out = {}
    for rank in range(ranks):
        try:
            out[str(rank)] = json.loads(Path(report_path + (f".rank{rank}" if rank else "")).read_text()).get("total_s")
        except (OSError, ValueError):
            out[str(rank)] = None
    return out


def engine_kwargs(args: argparse.Namespace, model_path: Path, cfg: dict) -> dict:
    """The keyword arguments of ``vllm.LLM`` for `args` (vLLM 0.24 signature)."""
    kw = dict(model=str(model_path), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              jit_monitor_verbose=True)  # vLLM logs every request-time compile with its key
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if getattr(args, "max_num_batched_tokens", None):
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.cudagraph == "off":
        kw["compilation_config"] = {"cudagraph_mode": "NONE"}
    if is_gdn_model(cfg) and args.gdn_prefill_backend not in (None, "", "default"):
        kw["additional_config"] = {"gdn_prefill_backend": args.gdn_prefill_backend}
    if getattr(args, "tensor_parallel_size", 1) > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
    kv_bytes = parse_bytes(args.kv_cache_memory_bytes)
    if kv_bytes:
        kw["kv_cache_memory_bytes"] = kv_bytes
    return kw


# ---------------------------------------------------------------------- environment

def _entries(path) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def default_vllm_cache_root(env) -> str:
    """vLLM's VLLM_CACHE_ROOT rule (envs.py), without importing vLLM."""
    if env.get("VLLM_CACHE_ROOT"):
        return os.path.expanduser(env["VLLM_CACHE_ROOT"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm")


def default_triton_cache(env) -> str:
    if env.get("TRITON_CACHE_DIR"):
        return env["TRITON_CACHE_DIR"]
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return os.path.join(home, ".triton", "cache")


def prepare_env(args: argparse.Namespace, env=None, tmp_root=None) -> dict:
    """Set the process environment for this run, before vLLM/Triton are imported.

    Returns the cache description stored in the result. Never touches DG_JIT_CACHE_DIR
    and keeps any VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR / KWARM_REPORT the user set.
    """
    env = os.environ if env is None else env
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: our hook sees its compiles
    cache = {"mode": args.triton_cache, "fresh_root": None}
    if args.triton_cache == "fresh":
        root = tempfile.mkdtemp(prefix="kwarm-bench-", dir=tmp_root)
        cache["fresh_root"] = root
        env["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(root, "vllm"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    elif args.triton_cache != "reuse":
        env["TRITON_CACHE_DIR"] = os.path.abspath(args.triton_cache)
        cache["mode"] = "dir"
    cache["triton_dir"] = default_triton_cache(env)
    cache["vllm_cache_root"] = default_vllm_cache_root(env)
    cache["triton_entries_at_start"] = _entries(cache["triton_dir"])
    cache["vllm_entries_at_start"] = _entries(cache["vllm_cache_root"])
    cache["inductor_dir"] = env.get("TORCHINDUCTOR_CACHE_DIR")
    cache["label"] = "warm" if cache["triton_entries_at_start"] or cache["vllm_entries_at_start"] else "cold"
    if cache["mode"] != "reuse":
        os.makedirs(cache["triton_dir"], exist_ok=True)

    if args.kwarm == "on":
        env["KWARM_ENABLE"] = "1"
        if not env.get("KWARM_REPORT"):
            fd, path = tempfile.mkstemp(prefix="kwarm-report-", suffix=".json", dir=tmp_root)
            os.close(fd)
            os.unlink(path)  # kwarm writes it; its absence afterwards means the warmup never ran
            env["KWARM_REPORT"] = path
    else:
        env["KWARM_ENABLE"] = "0"
    return cache


def activate_kwarm(mode: str) -> dict:
    """Make sure kwarm is on (or off) before vLLM is imported; returns what was found."""
    mod = sys.modules.get("kwarm_ext")
    if mode == "off":
        act = sys.modules.get("kwarm_ext.activation")
        door = sys.modules.get("_kwarm_door")  # the .pth door, armed at start-up, opens at vLLM's import
        if (act is not None and act.is_active()) or (door is not None and door.armed()):
            raise SystemExit("engine_bench: kwarm was activated at startup (KWARM_ENABLE exported?); "
                             "unset KWARM_ENABLE for --kwarm off")
        return {"active": False, "doors": []}
    try:
        import kwarm_ext
        from kwarm_ext import activation, config
    except ImportError as exc:
        raise SystemExit(f"engine_bench: --kwarm on but kwarm_ext is not importable: {exc}")
    if mod is not None:
        config.reset()  # a door parsed KWARM_* before this script set KWARM_REPORT
    try:
        # The plugin door fires inside vLLM; .pth (at vLLM's import) only when KWARM_ENABLE was set at startup.
        # This covers neither firing (e.g. a --target install without entry points).
        kwarm_ext.activate("bench")
    except Exception as exc:
        print(f"engine_bench: kwarm_ext.activate failed: {exc!r}", file=sys.stderr)
    return {"active": activation.is_active(), "doors": list(activation.SOURCES),
            "version": getattr(kwarm_ext, "__version__", None), "file": kwarm_ext.__file__}


# ------------------------------------------------------------------------ measuring

class GcTimer:
    """Python's garbage-collector passes (``gc.callbacks``), any thread: per generation, how
    many and how long. A full pass can cost milliseconds wherever it lands, which a profile
    charges to the function that happened to be running."""

    def __init__(self):
        self.counts, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            generation = info.get("generation", 2)
            self.counts[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._t0
            self._t0 = None

    def snapshot(self):
        return list(self.counts), list(self.seconds)

    def since(self, snap) -> dict:
        counts, seconds = snap
        return {"passes": [a - b for a, b in zip(self.counts, counts)],
                "ms": [round((a - b) * 1e3, 3) for a, b in zip(self.seconds, seconds)]}


class HostCounters:
    """What the host did to this thread during one request, to tell a slow request from a
    slow host. Nearly all of a request's time is this thread's CPU time (``cpu``), so the
    host's share hides in it: hypervisor steal (``/proc/stat``, all CPUs, in ms), this thread's context
    switches and page faults (``getrusage(RUSAGE_THREAD)``), and, where the kernel exposes
    them (``perf_event_open``; many VMs do not), the user-mode cycles and instructions this
    thread retired. Instructions do not move with clock speed, steal or cache misses, so
    their ratio says whether request 0 did more work than its repeat."""

    PERF_EVENTS = {"cycles": 0, "instructions": 1}  # PERF_TYPE_HARDWARE configs
    SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}

    def __init__(self):
        import resource
        self._resource = resource
        self.fds: dict[str, int] = {}
        self.perf_error = self._open_perf()

    def _open_perf(self) -> str | None:
        import ctypes
        import platform
        import struct
        number = self.SYS_PERF_EVENT_OPEN.get(platform.machine())
        if number is None:
            return f"no perf_event_open number for {platform.machine()}"
        libc = ctypes.CDLL(None, use_errno=True)
        for name, config in self.PERF_EVENTS.items():
            attr = bytearray(128)  # struct perf_event_attr, PERF_ATTR_SIZE_VER7 fits in 128
            struct.pack_into("IIQ", attr, 0, 0, len(attr), config)
            struct.pack_into("Q", attr, 40, (1 << 5) | (1 << 6))  # exclude_kernel, exclude_hv
            fd = libc.syscall(number, (ctypes.c_char * len(attr)).from_buffer(attr), 0, -1, -1, 0)
            if fd < 0:
                self.close()
                return f"perf_event_open({name}): {os.strerror(ctypes.get_errno())}"
            self.fds[name] = fd
        return None

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    @staticmethod
    def _steal_ms() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
            return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")  # cpu user nice system idle iowait irq softirq steal
        except (OSError, IndexError, ValueError):
            return None

    def snapshot(self):
        usage = self._resource.getrusage(self._resource.RUSAGE_THREAD)
        perf = {name: int.from_bytes(os.read(fd, 8), "little") for name, fd in self.fds.items()}
        return usage, self._steal_ms(), perf

    def since(self, snap) -> dict:
        usage0, steal0, perf0 = snap
        usage, steal, perf = self.snapshot()
        out = {"nvcsw": usage.ru_nvcsw - usage0.ru_nvcsw, "nivcsw": usage.ru_nivcsw - usage0.ru_nivcsw,
               "minflt": usage.ru_minflt - usage0.ru_minflt, "majflt": usage.ru_majflt - usage0.ru_majflt,
               "steal_ms": None if steal is None or steal0 is None else round(steal - steal0, 1)}
        if self.fds:
            out.update({name: perf[name] - perf0[name] for name in self.fds})
        return out


ALLOCATOR_STATS = (
    # torch.cuda.memory_stats(): cudaMalloc/cudaFree calls and segments (cumulative counters)
    "num_device_alloc", "num_device_free", "num_alloc_retries",
    "segment.small_pool.allocated", "segment.large_pool.allocated",
    # torch.cuda.host_memory_stats(): pinned host blocks created, and microseconds spent creating them
    "num_host_alloc", "host_alloc_time.total",
)


def allocator_counts() -> dict | None:
    """The caching allocators' cumulative counters (ALLOCATOR_STATS) where CUDA is there: a
    request that has to grow a pool calls cudaMalloc / cudaHostAlloc, which its repeat, served
    from the cache, does not. Counters this torch lacks are left out."""
    import torch

    if not torch.cuda.is_available():
        return None
    stats = dict(torch.cuda.memory_stats())
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        stats.update(host_stats())
    return {name: stats[name] for name in ALLOCATOR_STATS if name in stats}


def snapshots() -> bool:
    """Whether the device caching allocator can be read here (CUDA started, a torch with
    ``memory_snapshot``)."""
    import torch

    cuda = torch.cuda
    return cuda.is_available() and getattr(cuda, "is_initialized", lambda: False)() and hasattr(cuda, "memory_snapshot")


def segments() -> dict | None:
    """The device caching allocator's segments where CUDA is there: address -> (pool, bytes,
    stream) from ``torch.cuda.memory_snapshot()``. Each pool is per stream: a segment a request
    starts on a stream that a startup reserve did not use shows which stream to warm."""
    import torch

    if not snapshots():
        return None
    return {seg["address"]: (seg.get("segment_type"), seg["total_size"], seg.get("stream"))
            for seg in torch.cuda.memory_snapshot()}


def new_segments(before: dict | None, after: dict | None) -> list | None:
    """The segments in `after` that `before` lacks: ``[{"pool", "mib", "stream"}]``."""
    if before is None or after is None:
        return None
    return [{"pool": pool, "mib": round(size / (1 << 20), 2), "stream": stream}
            for address, (pool, size, stream) in sorted(after.items()) if address not in before]


def counts_since(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {name: after[name] - before.get(name, 0) for name in after}


class JitCounter:
    """A ``jit_post_compile_hook`` that records each in-memory compile and calls the hook
    it replaced (vLLM's JIT monitor chains the same slot and raises in its error mode:
    the chained call is not guarded, to stay faithful)."""

    def __init__(self):
        self.events: list[dict] = []
        self.enabled = True
        self.prev = None
        self.hook = None

    def install(self):
        from triton import knobs

        self.prev = knobs.runtime.jit_post_compile_hook
        prev = self.prev

        def hook(**kwargs):
            if self.enabled:
                try:
                    fn = kwargs.get("fn")
                    self.events.append({"name": str(getattr(fn, "name", "?")),
                                        "module": str(getattr(fn, "module", "?")),
                                        "key": str(kwargs.get("key"))})
                except Exception:
                    pass
            if prev is not None:
                return prev(**kwargs)
            return None

        self.hook = hook
        knobs.runtime.jit_post_compile_hook = hook
        return self


def deepgemm_dir(vllm_cache_root: str) -> str:
    """Where DeepGEMM JITs: DG_JIT_CACHE_DIR, which vLLM sets (utils/deep_gemm.py, at its
    lazy init) to $VLLM_CACHE_ROOT/deep_gemm when unset. Read only."""
    return os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(vllm_cache_root, "deep_gemm")


def deepgemm_sweep(model, max_tokens: int) -> dict:
    """Every token count 1..max_tokens through vLLM's ``fp8_gemm_nt`` on each distinct weight
    vLLM may run on DeepGEMM (2-D block-FP8 with scales, and ``should_use_deepgemm_for_fp8_linear``
    for its shape): a request of any length reaches no other linear-layer kernel, so none
    compiling here is the proof that none compiles in requests. Chosen by vLLM's own test, not
    by kwarm's. Runs in the worker (``LLM.apply_model``); scratch buffers per weight."""
    import torch
    from vllm.utils import deep_gemm

    seen, calls, t0 = [], 0, time.perf_counter()
    for module in model.modules():
        w = getattr(module, "weight", None)
        ws = getattr(module, "weight_scale_inv", getattr(module, "weight_scale", None))
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float8_e4m3fn or w.dim() != 2 or ws is None:
            continue
        n, k = w.shape
        if [n, k] in seen or not deep_gemm.should_use_deepgemm_for_fp8_linear(torch.bfloat16, (n, k)):
            continue
        seen.append([n, k])
        a = torch.empty(max_tokens, k, device=w.device, dtype=torch.float8_e4m3fn)
        # zeros, row-major, as vLLM's own warmup: 0.33 packs scales to UE8M0 and asserts on sign/mantissa bits
        a_s = torch.zeros(max_tokens, -(-k // 128), device=w.device, dtype=torch.float32)
        out = torch.empty(max_tokens, n, device=w.device, dtype=torch.bfloat16)
        for m in range(1, max_tokens + 1):
            deep_gemm.fp8_gemm_nt((a[:m], a_s[:m]), (w, ws), out[:m])
            calls += 1
        if w.is_cuda:
            torch.cuda.synchronize(w.device)
        del a, a_s, out
    return {"weights": seen, "calls": calls, "seconds": round(time.perf_counter() - t0, 2)}


def deepgemm_names(entries) -> dict:
    """{kernel name: count} of DeepGEMM cache entries (``.../kernel.<name>.<hash>``, or DeepJIT's
    ``.../<name>.<digest>`` in vLLM 0.34's vendored DeepGEMM), e.g. ``sm90_fp8_gemm_1d2d`` (fp8_gemm_nt)
    or ``sm90_m_grouped_fp8_gemm_contiguous_1d2d``."""
    names: dict = {}
    for entry in entries:
        parts = os.path.basename(entry).split(".")
        name = parts[1] if parts[0] == "kernel" and len(parts) > 2 else parts[0]
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def deepgemm_entries(root: str) -> set[str]:
    """DeepGEMM's compiled kernels below root: directories named kernel.<name>.<hash>, and DeepJIT's
    <name>.<digest> directories, committed by a ``.committed`` file (vLLM 0.34's vendored DeepGEMM)."""
    found = set()
    if not os.path.isdir(root):
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        if ".committed" in filenames and "." in os.path.basename(dirpath):
            found.add(os.path.relpath(dirpath, root))
        for d in dirnames:
            if d.startswith("kernel."):
                found.add(os.path.relpath(os.path.join(dirpath, d), root))
    return found


def sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def run_mixed(llm, req: Request, tag: str) -> int:
    """A step holding decodes and a prefill: requests added while others decode.

    V1's scheduler (chunked prefill always on) schedules the running requests' decode
    tokens first and fills the rest of the step's token budget with waiting prefills. So:
    queue the short prompts, step the engine twice (their prefill, then a decode: with
    async scheduling the first call may only launch the prefill), then queue the long
    prompts; the next step holds 2 decode tokens and the 600 prefill tokens. Submitting
    short and long prompts together in one ``generate`` would not do it: both fit the
    first step's token budget, are prefilled together, and then only decode.
    Returns the number of engine steps.
    """
    engine = llm.llm_engine
    n, length = req.mixed
    decoding = prompt_ids(req.batch, req.length, req.seed)
    prefill = prompt_ids(n, length, req.seed + 1000)

    def add(prompts, sp, part):
        if hasattr(llm, "enqueue"):  # LLM's own rendering + request ids (0.24+)
            llm.enqueue(prompts, sp, use_tqdm=False)
        else:
            for j, prompt in enumerate(prompts):
                engine.add_request(f"{tag}-{part}{j}", prompt, sp)

    add(decoding, sampling(req.max_tokens), "d")
    steps = 0
    for _ in range(2):
        engine.step()
        steps += 1
    add(prefill, sampling(16), "p")
    while engine.has_unfinished_requests() and steps < 10_000:
        engine.step()
        steps += 1
    return steps


def run_request(llm, req: Request, i: int) -> dict:
    steps = None
    if req.mixed is None:
        llm.generate(prompt_ids(req.batch, req.length, req.seed), sampling(req.max_tokens), use_tqdm=False)
    else:
        steps = run_mixed(llm, req, f"bench-{i}")
    return {"steps": steps} if steps is not None else {}


def _versions() -> dict:
    import platform

    import torch
    import triton
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}


def _jit_monitor_active():
    for name in ("vllm.triton_utils.jit_monitor", "vllm.utils.jit_monitor"):
        try:
            mod = __import__(name, fromlist=["is_active"])
            return bool(mod.is_active())
        except Exception:
            continue
    return None


def _count_names(events) -> list[dict]:
    counts: dict[str, int] = {}
    for e in events:
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    return [{"name": k, "count": v} for k, v in sorted(counts.items())]


def init_cut(out: Path, result: dict, t0: float, signum, frame) -> None:
    """SIGTERM (``timeout``, gpu_run.sh) before ``LLM()`` returned: write `result` with how long
    the start had run (``init_cut_s``, any wait for ``--sync-lock`` included), so that the table
    says "not done at N s" for a start that outlasted its call, then exit."""
    try:  # whatever happens, the process ends here: an exception would surface inside vLLM's start
        result["init_cut_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1, default=str))
        print(f"engine_bench: ended before init was done ({result['init_cut_s']} s); wrote {out}", flush=True)
    finally:
        os._exit(128 + signum)


def default_out(model: str, vllm_version: str, kwarm: str, label: str) -> Path:
    return HERE / "results" / f"{model}-vllm{vllm_version}-kwarm{kwarm}-{label}.json"


# ------------------------------------------------------------------------ profiling

PROFILE_ROWS = 50  # rows per ordering stored in the result
PROFILE_PRINTED = 15  # cumtime rows printed after the request line
PROFILE_KEYS = {"tottime": 2, "cumtime": 3}  # index in a pstats entry (cc, nc, tt, ct, callers)
REPO_PREFIX = str(HERE.parent).replace(os.sep, "/") + "/"


@functools.lru_cache(maxsize=None)
def _package_root(directory: str) -> str | None:
    """The outermost folder of the package holding `directory` (the last one, going up,
    with an ``__init__.py``), or None when `directory` is not in a package."""
    root = None
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        root = directory
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return root


def short_path(path: str) -> str:
    """A source path from the package folder on: the part after site-/dist-packages, else
    relative to this repository, else relative to the folder above the outermost package,
    else its last 4 components.
    Pseudo-paths (``<frozen ...>``, ``<string>``) stay as they are."""
    norm = path.replace(os.sep, "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in norm:
            return norm.rsplit(marker, 1)[1]
    if norm.startswith(REPO_PREFIX):  # this tree: bench/engine_bench.py
        return norm[len(REPO_PREFIX):]
    if os.path.isabs(path):
        root = _package_root(os.path.dirname(path))
        if root is not None:
            return os.path.relpath(path, os.path.dirname(root)).replace(os.sep, "/")
    return "/".join([part for part in norm.split("/") if part][-4:])


def profile_func(func: tuple[str, int, str]) -> str:
    """pstats' (file, line, name) as ``vllm/v1/worker/gpu_model_runner.py:123(_prepare_inputs)``;
    built-ins (file ``~``) as their name, e.g. ``<built-in method time.sleep>``."""
    file, line, name = func
    if file == "~" and line == 0:
        return name
    return f"{short_path(file)}:{line}({name})"


def profile_rows(stats: dict, key: str, n: int) -> list[dict]:
    """The `n` functions of ``pstats.Stats(...).stats`` with the largest `key` (``tottime`` or
    ``cumtime``): ``[{func, ncalls (primitive calls), tottime, cumtime}]``, seconds rounded to 4."""
    idx = PROFILE_KEYS[key]
    order = sorted(stats.items(), key=lambda item: (-item[1][idx], profile_func(item[0])))
    return [{"func": profile_func(func), "ncalls": int(cc), "tottime": round(tt, 4), "cumtime": round(ct, 4)}
            for func, (cc, _nc, tt, ct, _callers) in order[:n]]


def profile_summary(stats: dict, n: int = PROFILE_ROWS) -> dict:
    """The ``profile`` entry of a request: total profiled seconds (sum of tottime) and the top
    `n` rows by tottime and by cumtime."""
    return {"total_s": round(sum(entry[2] for entry in stats.values()), 4),
            "top_tottime": profile_rows(stats, "tottime", n),
            "top_cumtime": profile_rows(stats, "cumtime", n)}


def profile_diff(first: dict, repeat: dict, n: int = PROFILE_PRINTED) -> dict:
    """What a first request spent that its repeat did not, from both requests' raw stats
    (``pstats.Stats(...).stats``): the `n` functions with the largest tottime and cumtime
    differences, ``[{func, ncalls: [first, repeat], tottime, cumtime}]`` (seconds, rounded to 4;
    a function only one of them called counts 0 in the other)."""
    empty = (0, 0, 0.0, 0.0, {})
    rows = []
    for func in set(first) | set(repeat):
        a, b = first.get(func, empty), repeat.get(func, empty)
        rows.append({"func": profile_func(func), "ncalls": [int(a[0]), int(b[0])],
                     "tottime": round(a[2] - b[2], 4), "cumtime": round(a[3] - b[3], 4)})
    return {key: sorted(rows, key=lambda r: (-r[key], r["func"]))[:n] for key in ("tottime", "cumtime")}


def profile_diffs(requests: list, pairs: list) -> list:
    """``[{first, repeat, tottime, cumtime}]``: :func:`profile_diff` of each (first, repeat) pair
    whose requests were both profiled and whose raw stats are still on disk."""
    by_i = {r["i"]: r for r in requests}
    out = []
    for first, repeat in pairs:
        files = [by_i.get(i, {}).get("profile", {}).get("file") for i in (first, repeat)]
        if all(f and os.path.exists(f) for f in files):
            diff = profile_diff(*(pstats.Stats(f).stats for f in files))
            out.append({"first": first, "repeat": repeat, **diff})
    return out


def format_profile(rows: list[dict], n: int = PROFILE_PRINTED) -> str:
    """The first `n` rows as text, pstats-like: ncalls, tottime, cumtime, function."""
    lines = [f"  {'ncalls':>9} {'tottime':>9} {'cumtime':>9}  function"]
    lines += [f"  {r['ncalls']:>9} {r['tottime']:>9.4f} {r['cumtime']:>9.4f}  {r['func']}" for r in rows[:n]]
    return "\n".join(lines)


def format_diff(rows: list[dict]) -> str:
    """:func:`profile_diff` rows as text: calls (first/repeat), tottime and cumtime differences."""
    lines = [f"  {'ncalls':>11} {'d tottime':>10} {'d cumtime':>10}  function"]
    lines += [f"  {'/'.join(map(str, r['ncalls'])):>11} {r['tottime']:>10.4f} {r['cumtime']:>10.4f}  {r['func']}"
              for r in rows]
    return "\n".join(lines)


def profile_path(out: Path, i: int) -> Path:
    """Raw stats of request `i`, next to the result: ``<out stem>.req<i>.prof``."""
    return out.with_name(f"{out.stem}.req{i}.prof")


@contextlib.contextmanager
def profiling(profiler: cProfile.Profile | None):
    """`profiler` enabled for the block (nothing when None)."""
    if profiler is None:
        yield
        return
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()


CUDA_API_ROWS = 12


@contextlib.contextmanager
def cuda_profiling(enabled: bool, into: dict):
    """torch.profiler over the block when `enabled`; `into` then gets ``cuda_profile``: the
    CUDA runtime/driver calls with the most host time (``cudaGraphLaunch`` pays a graph's
    upload on its first launch, ``cuModuleLoad*``/``cuLibraryLoad*`` a lazily loaded kernel,
    ``cudaMalloc`` a new allocator segment) and the GPU kernels' total time."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    into["cuda_profile"] = cuda_profile_summary(prof.key_averages())


ALLOC_HISTORY_ENTRIES = 200_000
STACK_FRAMES = 8  # frames kept per new segment, innermost first, vLLM's and kwarm's before others


@contextlib.contextmanager
def alloc_history(enabled: bool, into: dict):
    """The caching allocator's history (``torch.cuda.memory._record_memory_history``, Python
    stacks) over the block when `enabled` and CUDA is there; `into` then gets ``alloc_stacks``
    (:func:`segment_stacks`)."""
    if not enabled or not snapshots():
        yield
        return
    import torch

    torch.cuda.memory._record_memory_history(max_entries=ALLOC_HISTORY_ENTRIES, stacks="python")
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    into["alloc_stacks"] = segment_stacks(snapshot)


def segment_stacks(snapshot: dict) -> list:
    """Each segment the recorded block started (``segment_alloc`` in the snapshot's device
    traces): ``{"mib", "stream", "frames"}``, the frames as ``file:line function``, innermost
    first, vLLM's and kwarm's (what asked) before torch's and Python's (how)."""
    out = []
    for traces in snapshot.get("device_traces") or ():
        for event in traces:
            if event.get("action") != "segment_alloc":
                continue
            frames = [f"{_short(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}"
                      for f in event.get("frames") or ()]
            ours = [f for f in frames if f.startswith(("vllm/", "kwarm_ext/"))]
            out.append({"mib": round(event.get("size", 0) / (1 << 20), 2), "stream": event.get("stream"),
                        "frames": (ours + [f for f in frames if f not in ours])[:STACK_FRAMES]})
    return out


def _short(filename: str) -> str:
    """A frame's file from its package on (``vllm/...``), else its last two parts."""
    for package in ("vllm", "kwarm_ext", "torch"):
        marker = f"/{package}/"
        if marker in filename:
            return package + "/" + filename.rsplit(marker, 1)[1]
    return "/".join(filename.split("/")[-2:])


def cuda_profile_summary(averages) -> dict:
    """The ``cuda_profile`` entry from torch.profiler's ``key_averages()``."""
    api = [e for e in averages if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudaDeviceSynchronize")]
    api.sort(key=lambda e: -e.self_cpu_time_total)
    kernels = [e for e in averages if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    return {"api": [{"name": e.key, "count": e.count, "host_ms": round(e.self_cpu_time_total / 1000, 3)}
                    for e in api[:CUDA_API_ROWS]],
            "gpu_kernels": sum(e.count for e in kernels),
            "gpu_ms": round(sum(e.self_device_time_total for e in kernels) / 1000, 3)}


def save_profile(profiler: cProfile.Profile, prof_file: Path) -> dict:
    """Dump the raw stats to `prof_file`; return the request's ``profile`` entry."""
    stats = pstats.Stats(profiler)
    stats.dump_stats(str(prof_file))
    return dict(profile_summary(stats.stats), file=str(prof_file))


# ------------------------------------------------------------ engines sharing a GPU

class EngineLock:
    """``flock(2)`` on a file that engines sharing one GPU agree on (``--sync-lock``).

    An engine holds it shared while it initializes (several may initialize together) and
    exclusive while it measures its requests, so that no engine measures while another
    one initializes or measures. Each context manager yields the seconds it waited. A
    process that dies releases its lock (flock semantics). ``EngineLock(None)`` never
    waits: both yield 0.0.
    """

    def __init__(self, path: str | None):
        self.path = path

    def shared(self):
        return self._hold(fcntl.LOCK_SH)

    def exclusive(self):
        return self._hold(fcntl.LOCK_EX)

    @contextlib.contextmanager
    def _hold(self, mode: int):
        if not self.path:
            yield 0.0
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            t = time.perf_counter()
            fcntl.flock(fd, mode)
            waited = time.perf_counter() - t
            try:
                yield waited
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- main

NO_CUDA = "engine_bench: needs a CUDA GPU (torch.cuda.is_available() is False)"


def require_cuda() -> None:
    """Exit with one line (NO_CUDA) when torch sees no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_path = resolve_model(args.model)
    cfg = json.loads((model_path / "config.json").read_text())
    try:
        scenario = build_scenario(args.scenario, args.repeats)
    except ValueError as exc:
        raise SystemExit(f"engine_bench: {exc}") from None
    bad = [i for i in args.profile + args.cuda_profile + args.alloc_stacks if i >= len(scenario)]
    if bad:
        raise SystemExit(f"engine_bench: --profile/--cuda-profile/--alloc-stacks {bad}: scenario {args.scenario!r} has "
                         f"{len(scenario)} requests (0..{len(scenario) - 1})")
    kwargs = engine_kwargs(args, model_path, cfg)
    lock = EngineLock(args.sync_lock)

    started = time.time()
    cache = prepare_env(args)
    kwarm_state = activate_kwarm(args.kwarm)
    dg_before_init = deepgemm_entries(deepgemm_dir(cache["vllm_cache_root"]))

    t0 = time.perf_counter()
    # Before the engine is built, no vLLM traceback: torch is imported inside the timed
    # stretch (vLLM imports it first thing anyway), so init_s keeps its meaning.
    require_cuda()
    init_counter = JitCounter().install()  # before LLM(): kwarm's capture and vLLM's monitor chain it
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    import_s = time.perf_counter() - t0
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in OPTIONAL_ENGINE_ARGS:
        if name in kwargs and name not in fields:
            kwargs.pop(name)
    import vllm

    out = Path(args.out) if args.out else default_out(model_path.name, vllm.__version__, args.kwarm, cache["label"])
    out.parent.mkdir(parents=True, exist_ok=True)
    cut = {"schema": table.SCHEMA, "model": model_path.name, "model_path": str(model_path),
           "architectures": cfg.get("architectures"), "scenario": args.scenario, "versions": {"vllm": vllm.__version__},
           "args": vars(args), "engine_kwargs": kwargs, "kwarm": args.kwarm, "variant": args.variant, "cache": cache,
           "import_s": round(import_s, 3), "init_s": None, "requests": [], "complete": False,
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started))}
    previous = signal.signal(signal.SIGTERM, functools.partial(init_cut, out, cut, t0))
    try:
        with lock.shared() as init_wait_s:  # other engines may initialize too, none measures
            llm = LLM(**kwargs)
    finally:
        signal.signal(signal.SIGTERM, previous)
    init_s = time.perf_counter() - t0 - init_wait_s
    init_counter.enabled = False

    import torch

    versions = _versions()
    versions["kwarm"] = kwarm_state.get("version")
    if args.kwarm == "on":  # the plugin door knocks inside LLM(): look again
        from kwarm_ext import activation

        kwarm_state.update(active=activation.is_active(), doors=list(activation.SOURCES))
    cache["triton_dir_after_init"] = os.environ.get("TRITON_CACHE_DIR")
    cache["deepgemm_dir"] = deepgemm_dir(cache["vllm_cache_root"])
    dg_init_entries = deepgemm_entries(cache["deepgemm_dir"]) - dg_before_init
    dg_init_new = len(dg_init_entries)

    report = None
    report_path = os.environ.get("KWARM_REPORT") if args.kwarm == "on" else None
    if report_path:
        try:
            report = json.loads(Path(report_path).read_text())
        except (OSError, ValueError) as exc:
            print(f"engine_bench: no kwarm report at {report_path}: {exc}", file=sys.stderr)

    requests: list[dict] = []
    result = {  # the fields known before init (`cut`), then what init told
        **cut,
        "versions": versions, "gpu": torch.cuda.get_device_name(0),
        "kwarm_active": kwarm_state["active"], "kwarm_doors": kwarm_state["doors"],
        "init_s": round(init_s, 3),
        "kwarm_warmup_s": table.total_seconds(report),
        "kwarm_warmup_s_ranks": rank_warmups(report_path, args.tensor_parallel_size),
        "kwarm_family_s": table.family_seconds(report),
        "init_jit": len(init_counter.events), "init_kernels": _count_names(init_counter.events),
        "deepgemm_init_new": dg_init_new, "deepgemm_init_kernels": deepgemm_names(dg_init_entries),
        "jit_monitor_active": _jit_monitor_active(),
        "kwarm_report_path": report_path,
        "kwarm_report_summary": table.summarize_report(report),
        "kwarm_report": report,
        "requests": requests,
        "sync": {"lock": args.sync_lock, "init_wait_s": round(init_wait_s, 3), "requests_wait_s": None}
        if args.sync_lock else None,
    }

    def write():
        # Rewritten after init and after every request: a run cut short keeps what it measured.
        result["total_jit"] = table.total_jit(result)
        result["pairs"] = [{"first": f, "repeat": r, "ratio": table.pair_ratio(result, f)}
                           for f, r in table.pairs(result)]
        result["first_steady_ratio"] = table.first_steady_ratio(result)
        result["excess_pairs"] = table.excess_pairs(result)
        result["excess_s"] = table.excess_s(result)
        result["excess_noise_s"] = table.excess_noise_s(result)
        result["first_steady_counters"] = table.first_steady_counters(result)
        result["control_ratio"] = table.control_ratio(result)
        result["wall_s"] = round(time.time() - started, 1)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, out)

    write()
    print(f"engine_bench: init {init_s:.1f} s ({len(init_counter.events)} Triton JIT), "
          f"kwarm warmup {result['kwarm_warmup_s']} s"
          + "".join(f", {name} {sec:.2f}" for name, sec in result["kwarm_family_s"].items()), flush=True)

    if args.cuda_profile:  # the profiler's own first use (CUPTI start-up) is not a request's
        with cuda_profiling(True, {}):
            torch.cuda.synchronize()
    counter = JitCounter().install()  # on top of vLLM's monitor, which it chains
    gc_timer = GcTimer()
    host = HostCounters()
    result["perf_counters"] = sorted(host.fds) or host.perf_error
    with lock.exclusive() as requests_wait_s:  # no other engine initializes or measures meanwhile
        if result["sync"]:
            result["sync"]["requests_wait_s"] = round(requests_wait_s, 3)
            print(f"engine_bench: waited {init_wait_s:.1f} s (init) + {requests_wait_s:.1f} s (requests) "
                  f"for {args.sync_lock}", flush=True)
        if args.settle_s > 0:
            time.sleep(args.settle_s)
        result["threads_at_request0"] = sorted(t.name for t in threading.enumerate())
        # the measuring thread's stream (vLLM's in-process engine runs on it), beside new_segments' streams
        result["stream_at_request0"] = torch.cuda.current_stream().cuda_stream if snapshots() else None
        # vLLM's aux stream (shared experts beside the routed ones), where created
        aux = getattr(sys.modules.get("vllm.utils.torch_utils"), "_aux_stream", None)
        result["aux_stream"] = getattr(aux, "cuda_stream", None)
        for i, req in enumerate(scenario):
            if req.pause_s:
                time.sleep(req.pause_s)
            dg_dir = deepgemm_dir(cache["vllm_cache_root"])
            dg0 = deepgemm_entries(dg_dir)
            n0 = len(counter.events)
            profiler = cProfile.Profile() if i in args.profile else None
            alloc0, segs0 = allocator_counts(), segments()
            traced: dict = {}
            # the diagnostics start before the clock and end after it (the allocator's snapshot,
            # the CUDA profiler's tables); what they cost meanwhile stays in "s": flagged "profiled"
            with profiling(profiler), cuda_profiling(i in args.cuda_profile, traced), \
                    alloc_history(i in args.alloc_stacks, traced):
                gc0 = gc_timer.snapshot()
                host0 = host.snapshot()
                cpu0 = (time.process_time(), time.thread_time())
                t = time.perf_counter()
                extra = run_request(llm, req, i)
                s = time.perf_counter() - t
                # CPU seconds of the whole process and of this thread: other threads busy meanwhile show as the gap
                cpu = {"process_s": round(time.process_time() - cpu0[0], 4),
                       "thread_s": round(time.thread_time() - cpu0[1], 4)}
                host_delta = host.since(host0)
                gc_passes = gc_timer.since(gc0)
            alloc = counts_since(alloc0, allocator_counts())
            if alloc and alloc.get("num_device_alloc") and (grown := new_segments(segs0, segments())) is not None:
                alloc["new_segments"] = grown  # which pool, size and stream grew
            profile = save_profile(profiler, profile_path(out, i)) if profiler is not None else None
            events = counter.events[n0:]
            requests.append({"i": i, "label": req.label, "batch": req.batch, "len": req.length,
                             "max_tokens": req.max_tokens, "repeat_of": req.repeat_of,
                             **({"control_of": req.control_of} if req.control_of is not None else {}),
                             "mixed": list(req.mixed) if req.mixed else None, "s": round(s, 4),
                             "jit": len(events), "kernels": [{"name": e["name"], "key": e["key"]} for e in events],
                             "deepgemm_new": len(dg_new := deepgemm_entries(dg_dir) - dg0),
                             "deepgemm_kernels": deepgemm_names(dg_new), "gc": gc_passes, "cpu": cpu, "host": host_delta,
                             "alloc": alloc, **extra})
            if profile is not None:
                requests[-1].update(profiled=True, profile=profile)
            if traced:
                requests[-1].update(profiled=True, **traced)
            print(f"request {i} {req.label}: {s:.3f} s, {len(events)} JIT "
                  f"{sorted({e['name'] for e in events})}, gc passes {gc_passes['passes']} "
                  f"{sum(gc_passes['ms']):.2f} ms, host {host_delta}, allocators {alloc}", flush=True)
            if "cuda_profile" in traced:
                cp = traced["cuda_profile"]
                print(f"  cuda profile: {cp['gpu_kernels']} kernels, {cp['gpu_ms']:.2f} ms GPU; host: "
                      + ", ".join(f"{a['name']} x{a['count']} {a['host_ms']:.2f} ms" for a in cp["api"][:6]),
                      flush=True)
            for seg in traced.get("alloc_stacks", ()):
                print(f"  new segment {seg['mib']} MiB on stream {seg['stream']}: {' <- '.join(seg['frames'][:3])}",
                      flush=True)
            if profile is not None:
                print(f"  profile: {profile['total_s']:.3f} s total, raw stats {profile['file']}; "
                      f"top {PROFILE_PRINTED} by cumtime:\n"
                      f"{format_profile(profile['top_cumtime'])}", flush=True)
                for diff in profile_diffs(requests, [(req.repeat_of, i)] if req.repeat_of is not None else []):
                    result.setdefault("profile_diffs", []).append(diff)
                    print(f"  profile, request {diff['first']} minus its repeat {i}, by tottime:\n"
                          + format_diff(diff["tottime"]), flush=True)
            write()
        if args.deepgemm_sweep:
            dg_dir = deepgemm_dir(cache["vllm_cache_root"])
            dg0 = deepgemm_entries(dg_dir)
            sweep = llm.apply_model(lambda model: deepgemm_sweep(model, args.max_num_batched_tokens))[0]
            sweep["new_kernels"] = deepgemm_names(deepgemm_entries(dg_dir) - dg0)
            result["deepgemm_sweep"] = sweep
            print(f"engine_bench: DeepGEMM sweep: {sweep['calls']} calls on {len(sweep['weights'])} weights in "
                  f"{sweep['seconds']} s, kernels compiled: {sweep['new_kernels'] or 'none'}", flush=True)
            write()
    host.close()
    result["complete"] = True
    write()
    print(f"engine_bench: wrote {out}")
    print(f"engine_bench: request JIT {result['total_jit']}, "
          f"excess {table.excess_cell(result)} ms, "
          f"first/steady {table.first_steady_cell(result)}, "
          f"control/steady {table.fmt_ratio(result['control_ratio'])}"
          + "".join(f", {name} {ratio:.3f}" for name, ratio in result["first_steady_counters"].items()))
    if cache["fresh_root"]:
        print(f"engine_bench: warm rerun: VLLM_CACHE_ROOT={cache['vllm_cache_root']} "
              f"TORCHINDUCTOR_CACHE_DIR={cache['inductor_dir']} "
              f"python {sys.argv[0]} {args.model} --kwarm {args.kwarm} --triton-cache {cache['triton_dir']}")
    print()
    print(table.render([result]))
    return 0


def flush_kwarm_learning() -> None:
    """os._exit below skips atexit, where kwarm saves what it learned (KWARM_LEARN)."""
    if "kwarm_ext.surfaces.triton.learn" in sys.modules:
        try:
            sys.modules["kwarm_ext.surfaces.triton.learn"].flush()
        except Exception as exc:  # the result is written already; say why the manifest may lag
            print(f"engine_bench: kwarm's manifest flush failed: {exc!r}", file=sys.stderr)


if __name__ == "__main__":
    code = main()
    flush_kwarm_learning()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: an in-process engine's threads can hang it, and the
    # result is already written.
    os._exit(code)
