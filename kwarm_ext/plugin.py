"""The ``vllm.general_plugins`` entry point (door 3).

vLLM calls it in the API process, in EngineCore and in every worker
(``WorkerWrapperBase.init_worker``), before ``vllm.v1.worker.gpu_worker`` is imported,
possibly several times per process, and does not guard the call: so it is re-entrant
and raises nothing (unless KWARM_STRICT asks for a hard failure). ``VLLM_PLUGINS``,
when set, must name ``kwarm`` for vLLM to call it.
"""


def register() -> None:
    try:
        import kwarm_ext

        kwarm_ext.activate("plugin")
    except Exception as exc:  # activate() already logs; this guards its import
        import sys

        sys.stderr.write(f"WARNING kwarm: plugin failed, kwarm is off in this process: {exc!r}\n")
        from kwarm_ext import config

        if config.is_enabled() and config.strict():
            raise
