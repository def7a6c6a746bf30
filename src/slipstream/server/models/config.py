"""The architecture numbers of a Llama-family checkpoint, whatever file it came from."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",  # served as its text decoder
}


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM; Gemma 2 and 3 in :mod:`.gemma`).

    ``rope_scaling`` is the checkpoint's dict (``rope_type`` ``"linear"``, ``"llama3"``, or a GGUF's
    ``"freq_factors"``) or None.
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
    # Sliding-window attention (Mistral, Qwen2, Gemma): ``layer_windows[i]`` is layer i's window in
    # tokens (None: full attention); an empty list means every layer attends the whole context.
    layer_windows: list[int | None] = field(default_factory=list)
    # Gemma: scores and final logits soft-capped (Gemma 2), attention scale query_pre_attn_scalar ** -0.5,
    # RoPE base of the sliding layers (Gemma 3; None: rope_theta).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    # Qwen3: RMSNorm over each head's q and k (weight [head_dim]) after the projection, before RoPE.
    qk_norm: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE): layers in ``moe_layers`` replace the dense MLP by
    # ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` per
    # token; ``norm_topk_prob`` rescales the chosen experts' softmax weights to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any layer, or None when no layer slides."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def kv_window(self) -> int | None:
        """Tokens behind a query whose K/V some layer still reads: the largest window when every
        layer slides (Mistral, Mixtral), else None (a full-attention layer, as in Gemma's
        interleaving, needs the whole context, so no block can be released)."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def eos_ids(tokenizer) -> set[int]:
    """The tokenizer's end-of-sequence token id, as a set (empty when it has none)."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
