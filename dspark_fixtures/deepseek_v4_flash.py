# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The published DeepSeek-V4-Flash config: one source for the tiny V4 target, the memory
benchmark and the launcher's serving-flag tests.

Values from the config.json of deepseek-ai/DeepSeek-V4-Flash. Torch-free, so that
launcher tests read it without importing torch.
"""

# V4-Flash's linears: FP8 e4m3 with one ue8m0 scale per 128x128 block.
V4_FP8_LINEARS: dict = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}

V4_FLASH_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "compress_ratios": [0, 0, *([4, 128] * 20), 0],
    "compress_rope_theta": 160000,
    "index_topk": 512,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "num_hash_layers": 3,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "fp4",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": V4_FP8_LINEARS,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}
FP8_BLOCK = 128  # rows and columns an FP8 linear's ue8m0 scale covers
MXFP4_GROUP = 32  # values an MXFP4 expert weight's e8m0 scale covers
