"""kda inside transformers' Kimi Linear (`transformers.models.kimi_linear`, transformers >= 5.23)::

    import kda.transformers
    model = kda.transformers.patch(model, backend="reference", schedule="overlapped")
    out = model.generate(ids, max_new_tokens=32)

`patch` replaces every `KimiLinearDeltaAttention` of the model with a module that runs kda's
layer, built from the module's own parameters (`kda.Layer.from_weights`, no checkpoint
directory), and keeps transformers' `DynamicCache` conventions: the states stay in the model's
`past_key_values` (conv `[B, 3 P, W]` in the model dtype, recurrent `[B, H, K, V]` f32, K first),
which kda updates in place (`Layer.wrap_cache(layout="transformers")`), so a prefill, decode
steps and a cache made or read by transformers' own code all work unchanged.

This module imports neither torch nor transformers until `patch` is called: `import kda` stays
light.

Numerics: kda rounds the projection weights and activations to bf16 (its mixed-precision path,
`docs/design/kda.md`), where transformers' torch path computes them in the model dtype; the
logits of an f32 model therefore agree to bf16 rounding (about 1e-2 relative), not bit for bit.
"""

_MODULE = None


def _checkpoint_names(module, prefix):
    """`module`'s parameters under the checkpoint's names (transformers' conversion mapping for
    kimi_linear, reversed: `forget_gate.*` back to the attention, the stacked `conv1d` split
    into `q_conv1d` / `k_conv1d` / `v_conv1d`)."""
    p = module.qkv_dim
    conv = module.conv1d.weight.detach()
    fg = module.forget_gate
    named = {
        "q_proj.weight": module.q_proj.weight,
        "k_proj.weight": module.k_proj.weight,
        "v_proj.weight": module.v_proj.weight,
        "b_proj.weight": module.b_proj.weight,
        "f_a_proj.weight": fg.f_a_proj.weight,
        "f_b_proj.weight": fg.f_b_proj.weight,
        "g_a_proj.weight": module.g_a_proj.weight,
        "g_b_proj.weight": module.g_b_proj.weight,
        "q_conv1d.weight": conv[:p],
        "k_conv1d.weight": conv[p:2 * p],
        "v_conv1d.weight": conv[2 * p:],
        "A_log": fg.A_log,
        "dt_bias": fg.dt_bias,
        "o_norm.weight": module.o_norm.weight,
        "o_proj.weight": module.o_proj.weight,
    }
    if module.conv1d.bias is not None:
        raise ValueError("kda.transformers: a conv1d bias is not part of the KDA layer")
    return {prefix + k: v.detach().contiguous() for k, v in named.items()}


def _module_class():
    """The replacement module's class, made once torch is imported."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    import torch
    from torch import nn

    class KdaDeltaAttention(nn.Module):
        """A `KimiLinearDeltaAttention` run by kda (see `kda.transformers`)."""

        def __init__(self, module, config, backend, schedule):
            super().__init__()
            import kda

            self.layer_idx = module.layer_idx
            self.hidden_size = module.hidden_size
            self.conv_kernel_size = module.conv_kernel_size
            self.conv_dim = module.conv_dim
            self.num_heads = module.num_heads
            self.head_dim = module.head_dim
            self.layer_type = getattr(module, "layer_type", "linear_attention")
            prefix = f"model.layers.{self.layer_idx}.self_attn."
            weights = _checkpoint_names(module, prefix)
            self.kda = kda.Layer.from_weights(config, weights, layer=self.layer_idx,
                                              backend=backend, schedule=schedule)

        def extra_repr(self):
            return f"layer_idx={self.layer_idx}, kda={self.kda!r}"

        def _states(self, cache, batch, dtype):
            """The layer's conv and recurrent state tensors in `cache` (made zero, as
            transformers' prefill does, when the layer has no previous state), and the number of
            tokens already processed into them (0: a fresh prefill)."""
            idx = self.layer_idx
            conv = cache.get_conv_state(idx)
            recurrent = cache.get_recurrent_state(idx)
            if conv is not None and recurrent is not None:
                seen = getattr(cache.layers[idx], "_kda_tokens", None)
                return conv, recurrent, seen if seen else 1
            zeros = torch.zeros(batch, self.conv_dim, self.conv_kernel_size, dtype=dtype)
            cache.update_conv_state(zeros, idx, conv_kernel_size=self.conv_kernel_size)
            state = torch.zeros(batch, self.num_heads, self.head_dim, self.head_dim,
                                dtype=torch.float32)
            cache.update_recurrent_state(state, idx)
            cache.layers[idx]._kda_tokens = 0
            return cache.get_conv_state(idx), cache.get_recurrent_state(idx), 0

        def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            if attention_mask is not None:
                # transformers zeroes the padding tokens' inputs (apply_mask_to_padding_states).
                hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
            batch, seq_len, width = hidden_states.shape
            dtype = hidden_states.dtype
            x = hidden_states.detach().reshape(batch * seq_len, width)
            if x.dtype not in (torch.float32, torch.bfloat16):
                x = x.float()
            x = x.contiguous()
            out_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) \
                else torch.float32
            out = torch.empty(batch * seq_len, width, dtype=out_dtype)
            qsl = [r * seq_len for r in range(batch + 1)]
            if cache_params is None:
                cache = self.kda.new_cache(num_slots=batch)
                computed = None
            else:
                state_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) \
                    else torch.float32
                conv, recurrent, seen = self._states(cache_params, batch, state_dtype)
                cache = self.kda.wrap_cache(conv, recurrent, layout="transformers")
                computed = [seen] * batch
            self.kda.forward(x, qsl, cache, num_computed_tokens=computed, out=out)
            if cache_params is not None:
                layer_cache = cache_params.layers[self.layer_idx]
                layer_cache._kda_tokens = (getattr(layer_cache, "_kda_tokens", 0) or 0) + seq_len
            return out.reshape(batch, seq_len, width).to(dtype)

    _MODULE = KdaDeltaAttention
    return _MODULE


def patch(model, backend="reference", schedule="overlapped"):
    """Replace every `KimiLinearDeltaAttention` of the transformers Kimi Linear `model` with a
    module running kda's layer (built from the module's own parameters, `schedule`
    "serial" or "overlapped", on `backend`). Returns `model` itself."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    cls = _module_class()
    config = model.config
    replaced = 0
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, kimi.KimiLinearDeltaAttention):
                setattr(parent, child_name, cls(child, config, backend, schedule))
                replaced += 1
    if replaced == 0:
        raise ValueError("kda.transformers.patch: the model has no KimiLinearDeltaAttention")
    return model
