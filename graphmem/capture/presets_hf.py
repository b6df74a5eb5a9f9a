"""Bundled Hugging Face configs of popular families, so ``graphmem analyze llama-3.1-8b`` works
offline. Each is the model's published config.json on the Hugging Face hub (the repository is
named beside it), kept to the fields that shape the model; tokenizer ids, generation settings
label names and generation flags (Gemma 2's cache_implementation) are left out (they do not change memory; ViT's 1000 ImageNet labels are given
as ``num_labels``). Where the published file names custom code (``auto_map``: Phi-3's first
release) it is dropped, because transformers has the family built in.

Name clashes: a bundled graphmem model keeps its name (``gpt2`` is models/gpt2.py); the
Hugging Face config of that name takes the prefix ``hf-`` (``hf-gpt2``).
"""
from __future__ import annotations

from typing import Any

_LLAMA_31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_LLAMA_32_ROPE = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# name -> (hub repository, config.json fields)
HF_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA_31_ROPE, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 8192, "intermediate_size": 28672,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 64, "num_hidden_layers": 80,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA_31_ROPE, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 24,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA_32_ROPE,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256}),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 32000}),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32000}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
        "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064}),
    "gemma-2-9b": ("google/gemma-2-9b", {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
        "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000}),
    "phi-3-mini": ("microsoft/Phi-3-mini-4k-instruct", {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
        "attention_dropout": 0.0, "embd_pdrop": 0.0, "hidden_act": "silu", "hidden_size": 3072,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
        "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 32064}),
    "hf-gpt2": ("openai-community/gpt2", {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "attn_pdrop": 0.1, "embd_pdrop": 0.1, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
        "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1,
        "vocab_size": 50257}),
    "bert-base": ("google-bert/bert-base-uncased", {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
        "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
        "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
        "type_vocab_size": 2, "vocab_size": 30522}),
    "t5-base": ("google-t5/t5-base", {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_ff": 3072, "d_kv": 64,
        "d_model": 768, "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1,
        "feed_forward_proj": "relu", "initializer_factor": 1.0, "is_encoder_decoder": True,
        "layer_norm_epsilon": 1e-06, "n_positions": 512, "num_heads": 12, "num_layers": 12, "pad_token_id": 0,
        "relative_attention_num_buckets": 32, "vocab_size": 32128}),
    "vit-base": ("google/vit-base-patch16-224", {
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "attention_probs_dropout_prob": 0.0,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "hidden_size": 768, "image_size": 224,
        "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-12, "num_attention_heads": 12,
        "num_channels": 3, "num_hidden_layers": 12, "num_labels": 1000, "patch_size": 16, "qkv_bias": True}),
    "falcon-7b": ("tiiuae/falcon-7b", {
        "architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": False,
        "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "bias": False,
        "bos_token_id": 11, "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 4544,
        "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "multi_query": True,
        "new_decoder_architecture": False, "num_attention_heads": 71, "num_hidden_layers": 32,
        "parallel_attn": True, "torch_dtype": "bfloat16", "vocab_size": 65024}),
}


def hub_ids() -> dict[str, str]:
    """hub repository -> preset name (to name the preset when that repository is out of reach)."""
    return {repo.lower(): name for name, (repo, _) in HF_PRESETS.items()}
