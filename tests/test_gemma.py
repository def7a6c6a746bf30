"""Gemma 2 and Gemma 3 (text, and the text part of the multimodal checkpoint): greedy output equals
transformers' token for token on tiny random-weight checkpoints with interleaved local (16-token
window) and global layers and prompts longer than the window — alone, batched, chunked,
preempted and after a prefix-cache hit (see ``tiny_checkpoints``).
"""
from __future__ import annotations

import pytest
import torch

from tiny_checkpoints import assert_not_degenerate, check_engine_modes, hf_greedy, prompts, save_checkpoint

WINDOW = 16
SHAPES = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, sliding_window=WINDOW, max_position_embeddings=512, initializer_range=0.2,
              rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")


def _eos() -> int:
    from slipstream.server.models.loader import load_tokenizer
    return load_tokenizer("builtin").eos_token_id


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    eos = _eos()
    # query_pre_attn_scalar != head_dim and small caps, so a wrong scale or a missing cap shows.
    config = Gemma2Config(**SHAPES, num_hidden_layers=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                          final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=eos, pad_token_id=eos)
    return Gemma2ForCausalLM, config, Gemma2ForCausalLM


def gemma3_text():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    eos = _eos()
    config = Gemma3TextConfig(**SHAPES, num_hidden_layers=6, query_pre_attn_scalar=24, sliding_window_pattern=6,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1_000_000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                              bos_token_id=1, eos_token_id=eos, pad_token_id=eos)
    return Gemma3ForCausalLM, config, Gemma3ForCausalLM


def gemma3_multimodal():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
    model_cls, text, _ = gemma3_text()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=49151, boi_token_index=49149, eoi_token_index=49150,
                          initializer_range=0.2, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    return Gemma3ForConditionalGeneration, config, Gemma3ForConditionalGeneration


MODELS = {"gemma2": gemma2, "gemma3-text": gemma3_text, "gemma3-multimodal": gemma3_multimodal}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    """(name, path, prompts, transformers' greedy output, the same without sliding windows)."""
    model_cls, config, hf_cls = MODELS[request.param]()
    path = save_checkpoint(model_cls, config, tmp_path_factory.mktemp(request.param), post_norm_gain=4.0)
    ps = prompts(path, WINDOW)
    eos = _eos()
    expected = hf_greedy(path, hf_cls, ps, eos)
    full = dict(layer_types=["full_attention"] * config.get_text_config().num_hidden_layers)
    if request.param == "gemma3-multimodal":
        from transformers import Gemma3Config
        text = {**config.text_config.to_dict(), **full}
        unwindowed = hf_greedy(path, hf_cls, ps, eos, config=Gemma3Config(**{**config.to_dict(), "text_config": text}))
    else:
        unwindowed = hf_greedy(path, hf_cls, ps, eos, **full)
    return request.param, path, ps, expected, unwindowed


def test_config_has_interleaved_windows_softcaps_and_rope_bases(checkpoint):
    from slipstream.server.models.gemma import GemmaModel
    from slipstream.server.models.loader import load_model
    name, path, *_ = checkpoint
    loaded = load_model(str(path), torch.device("cpu"), torch.float32)
    cfg = loaded.config
    assert isinstance(loaded.model, GemmaModel)
    assert cfg.query_pre_attn_scalar == 24 and cfg.tie_word_embeddings
    if name == "gemma2":
        assert cfg.layer_windows == [16, None, 16, None]
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (5.0, 30.0)
        assert [layer.self_attn.softcap for layer in loaded.model.layers] == [5.0] * 4
    else:
        assert cfg.layer_windows == [16] * 5 + [None]
        assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
        assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 8.0
        assert all(layer.self_attn.softcap is None and layer.self_attn.qk_norm for layer in loaded.model.layers)
        assert not torch.allclose(loaded.model.inv_freq, loaded.model.local_inv_freq)
    assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight


def test_greedy_tokens_equal_transformers_in_every_engine_mode(checkpoint, no_leaks):
    _, path, ps, expected, unwindowed = checkpoint
    assert_not_degenerate(expected)
    assert unwindowed != expected, "the local layers' window should change the output"
    check_engine_modes(path, ps, expected, no_leaks)


@pytest.mark.parametrize("stored, own", [
    ("model.language_model.layers.0.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"),  # transformers 5
    ("language_model.model.norm.weight", "norm.weight"),  # as saved (4.x layout)
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.embed_tokens.weight", "embed_tokens.weight"),  # Gemma3ForCausalLM, Gemma2ForCausalLM
    ("lm_head.weight", "lm_head.weight"),
    ("vision_tower.encoder.layers.0.mlp.fc1.weight", None),
    ("model.multi_modal_projector.mm_input_projection_weight", None),
])
def test_multimodal_checkpoint_names_map_to_the_text_decoder(stored, own):
    from slipstream.server.models.gemma import _text_name
    assert _text_name(stored) == own


def test_older_gemma3_config_keys_give_the_same_fields():
    from slipstream.server.models.gemma import config_fields
    old = dict(hidden_activation="gelu_pytorch_tanh", num_hidden_layers=6, sliding_window=16, sliding_window_pattern=6,
               rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               query_pre_attn_scalar=256, head_dim=256)
    fields = config_fields(old)
    assert fields["layer_windows"] == [16] * 5 + [None]
    assert (fields["rope_theta"], fields["rope_local_theta"]) == (1e6, 1e4)
    assert fields["rope_scaling"]["factor"] == 8.0
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported"):
        config_fields({**old, "hidden_activation": "gelu"})
