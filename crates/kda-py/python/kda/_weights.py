"""What `kda.Layer.from_weights` does on the Python side: a model config (a dict, a JSON string,
or an object with the HF fields such as transformers' `KimiLinearConfig`) as the `config.json`
text kda reads, and a name -> array mapping as arrays kda can read (torch parameters detached).
Imports neither torch nor transformers."""

import json

# The keys of config.json a KDA layer reads (kda-model's `KdaConfig`).
_TOP = ("hidden_size", "rms_norm_eps", "use_full_rank_gate", "qkv_quantization")
_LINEAR = ("num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound")
# transformers' KimiLinearConfig keeps linear_attn_config's values under these names.
_FLAT = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}


def _as_dict(config):
    if isinstance(config, str):
        return json.loads(config)
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        d = dict(config.to_dict())
        # Attributes set after construction (transformers' __post_init__) win.
        for key in _TOP + tuple(_FLAT.values()) + ("linear_attn_config",):
            if hasattr(config, key):
                d[key] = getattr(config, key)
        return d
    return {k: getattr(config, k) for k in dir(config) if not k.startswith("_")}


def config_json(config):
    """The config.json text of `config`."""
    d = _as_dict(config)
    linear = dict(d.get("linear_attn_config") or {})
    for key, flat in _FLAT.items():
        if key not in linear and d.get(flat) is not None:
            linear[key] = d[flat]
    out = {k: d[k] for k in _TOP if d.get(k) is not None}
    out["linear_attn_config"] = {k: linear[k] for k in _LINEAR if linear.get(k) is not None}
    return json.dumps(out)


def named_arrays(weights):
    """`weights` (a mapping or (name, array) pairs) as a list of (name, array); torch tensors
    are detached (a parameter that requires grad cannot be exported through DLPack)."""
    items = weights.items() if hasattr(weights, "items") else weights
    out = []
    for name, array in items:
        if hasattr(array, "detach"):
            array = array.detach()
        out.append((str(name), array))
    return out
