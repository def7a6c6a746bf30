"""The architecture numbers of a Llama-family checkpoint, whatever file it came from."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM).

    ``rope_scaling`` is the checkpoint's dict (``rope_type`` ``"linear"`` or ``"llama3"``) or None.
    ``attention_bias`` is True for Qwen2 (biases on the q/k/v projections).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
