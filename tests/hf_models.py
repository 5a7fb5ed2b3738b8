"""Random `transformers` models the HF tests share (tests/test_moe.py, tests/test_hf_checks.py)."""
import torch


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
