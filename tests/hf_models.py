"""Random `transformers` models the HF tests share (tests/test_moe.py, tests/test_hf_checks.py,
tests/test_hf_families.py, tests/test_hf_llama.py)."""
import torch

SEQ, WINDOW, ORIGINAL = 64, 8, 16  # the context, Mistral's window, the rope scaling's original context
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # head_dim 8: wavelengths 6 (smoothed), 63.. (scaled)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# name: (transformers class prefix, its config's fields beside the shared sizes)
FAMILIES = {"llama3": ("Llama", {"rope_parameters": LLAMA3}), "yarn": ("Llama", {"rope_parameters": YARN}),
            "qwen2": ("Qwen2", {}), "qwen3": ("Qwen3", {"head_dim": 12}),
            "mistral": ("Mistral", {"sliding_window": WINDOW})}


def float64_norms(model):
    """transformers' RMSNorms normalise in float32 whatever the model's dtype (a bf16 guard):
    each computes in the model's dtype instead (the same formula), so float64 logits agree to 1e-9."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = forward.__get__(m)
    return model


def sharpened(model):
    """`model` with its norms and biases perturbed and its queries and keys scaled up (sharp
    attention), so that a misplaced tensor, a wrong window or wrong angles cannot go unseen."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    return model


def random_family(name, path):
    """A random float64 model of FAMILIES[name] (2 layers, hidden 32, 4 heads on 2 kv heads,
    vocab 256), saved by transformers to `path`, its norms computing in float64; norms and
    biases perturbed and queries and keys scaled up (sharp attention), so that a misplaced
    tensor, a wrong window or wrong angles cannot go unseen."""
    import transformers

    prefix, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).double().eval()
    sharpened(model)
    model.save_pretrained(str(path))
    return float64_norms(model)


def float64_mixtral(path, experts: int = 4, top_k: int = 2, float32_parts: bool = False, seed: int = 0):
    """A random transformers Mixtral in float64, saved to `path`. Its router's softmax and its
    RMSNorms compute in float32 whatever the model's dtype (guards for bf16); unless
    `float32_parts`, those modules are swapped for ones computing in the model's dtype, so
    that float64 logits can agree to 1e-9 (the same weights, the same formulas)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm, MixtralTopKRouter

    class Float64Norm(MixtralRMSNorm):
        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    class Float64Router(MixtralTopKRouter):
        def forward(self, hidden_states):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            top, idx = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
            return logits, top / top.sum(-1, keepdim=True), idx

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
                        experts_implementation="eager")
    model = MixtralForCausalLM(cfg).double().eval()
    model.save_pretrained(str(path))
    if not float32_parts:
        def swap(owner, name, new):
            new.load_state_dict(getattr(owner, name).state_dict())
            setattr(owner, name, new.double())
        for layer in model.model.layers:
            swap(layer.mlp, "gate", Float64Router(cfg))
            swap(layer, "input_layernorm", Float64Norm(cfg.hidden_size, cfg.rms_norm_eps))
            swap(layer, "post_attention_layernorm", Float64Norm(cfg.hidden_size, cfg.rms_norm_eps))
        swap(model.model, "norm", Float64Norm(cfg.hidden_size, cfg.rms_norm_eps))
    return model
