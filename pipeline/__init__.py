"""lora-pipeline: train -> validate -> register -> publish LoRA adapters for a vLLM fleet."""

__version__ = "0.1.0"
