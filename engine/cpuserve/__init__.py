"""cpuserve: LLM serving on CPUs.

Names are imported on first use, so that the API process (which never runs
model code) does not pay for importing torch.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "LoRARequest"]

_WHERE = {"LLM": "cpuserve.entrypoints.llm", "SamplingParams": "cpuserve.core.sampling_params", "EngineConfig": "cpuserve.config",
          "RequestOutput": "cpuserve.engine.outputs", "CompletionOutput": "cpuserve.engine.outputs",
          "LoRARequest": "cpuserve.core.lora_request"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'cpuserve' has no attribute {name!r}")
