"""cpuserve: LLM serving on CPUs."""
from cpuserve.config import EngineConfig
from cpuserve.llm import LLM
from cpuserve.outputs import CompletionOutput, RequestOutput
from cpuserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
