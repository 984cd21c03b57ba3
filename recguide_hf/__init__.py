"""recguide-hf: RecGuide self-speculative decoding for Hugging Face transformers."""

from transformers import AutoConfig, AutoModelForCausalLM

from .config import DecodingConfig
from .generate import RecGuideGenerateOutput, generate
from .modeling import RecGuideConfig, RecGuideForCausalLM

__version__ = "0.1.0"

AutoConfig.register("recguide", RecGuideConfig, exist_ok=True)
AutoModelForCausalLM.register(RecGuideConfig, RecGuideForCausalLM, exist_ok=True)

__all__ = ["DecodingConfig", "RecGuideConfig", "RecGuideForCausalLM", "RecGuideGenerateOutput", "generate",
           "__version__"]
