"""kda inside transformers' own Kimi Linear: `kda.transformers.patch` against the unpatched
model (transformers' torch path on the CPU is the oracle no one here wrote), and the
`"transformers"` cache layout against transformers' own DynamicCache contents.

Tolerance: kda rounds the projections (weights and activations) to bf16 by design, where the
unpatched f32 model computes them in f32; each KDA layer's output then differs by bf16 rounding
(2^-8 relative) that the next layers carry on: the logits of this 5-layer model differ by at
most `LOGIT_TOL` (2^-5) of their largest magnitude (measured: 0.7 to 1.3 % over a 130-token
prefill and 3 decode steps), and the cached states likewise (measured: up to 0.8 % for the conv
history, 1.3 % for the recurrent state, of their largest magnitude). Greedy tokens are equal.
"""

import copy
import importlib
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

# flash-linear-attention's Triton kernels need a GPU: hide it, so transformers takes its torch
# path (it falls back when the package is missing).
if importlib.util.find_spec("fla") is not None:
    sys.modules["fla"] = None



def _need(name):
    """`name`, imported; skipped without it, except under CI (`.ci/run` installs torch and
    transformers into the test venv, and the suite must not silently skip there)."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


torch = _need("torch")
transformers = _need("transformers")

import kda  # noqa: E402
import kda.transformers  # noqa: E402

LOGIT_TOL = 2.0 ** -5
STATE_TOL = 2.0 ** -5


def tiny_model(seed=0):
    """A random Kimi Linear: 4 KDA layers and one MLA layer, hidden 128, 4 KDA heads of 32."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    config = KimiLinearConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
        num_local_experts=4, num_experts_per_tok=2, mlp_layer_types=["dense"] * 5,
        linear_num_heads=4, linear_head_dim=32, linear_conv_kernel_dim=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    model = KimiLinearForCausalLM(config).eval()
    # Larger weights than the default init (std 0.02) so the logits are not all alike.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or "embed" in name or "lm_head" in name:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def models():
    ref = tiny_model()
    patched = kda.transformers.patch(copy.deepcopy(ref), backend="reference",
                                     schedule="overlapped")
    return ref, patched


def kda_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "KdaDeltaAttention"]


def assert_logits_close(a, b):
    a, b = a.float().numpy(), b.float().numpy()
    atol = LOGIT_TOL * float(np.abs(a).max())
    np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def test_import_kda_stays_light():
    code = ("import sys, kda, kda.transformers; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_patch_replaces_every_kda_layer_and_keeps_the_rest(models):
    ref, patched = models
    layers = kda_layers(patched)
    assert [m.layer_idx for m in layers] == [0, 1, 2, 3]
    assert type(patched.model.layers[4].self_attn).__name__ == "KimiLinearAttention"
    with pytest.raises(ValueError, match="no KimiLinearDeltaAttention"):
        kda.transformers.patch(patched)


def test_greedy_generate_gives_the_same_tokens(models):
    ref, patched = models
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=12, do_sample=False)
        got = patched.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_prefill_then_decode_through_past_key_values(models):
    """A 130-token prefill (two chunk boundaries), then decode steps through the same
    DynamicCache: logits within the tolerance at every step, and the cache holds what
    transformers' own layers would have written there."""
    from transformers import DynamicCache

    ref, patched = models
    ids = torch.randint(3, 256, (1, 130), generator=torch.Generator().manual_seed(2))
    caches = [DynamicCache(config=ref.config), DynamicCache(config=ref.config)]
    with torch.no_grad():
        outs = [m(ids, past_key_values=c, use_cache=True)
                for m, c in zip((ref, patched), caches)]
        assert_logits_close(outs[0].logits, outs[1].logits)
        for step in range(3):
            token = outs[0].logits[:, -1:].argmax(-1)
            outs = [m(token, past_key_values=c, use_cache=True)
                    for m, c in zip((ref, patched), caches)]
            assert_logits_close(outs[0].logits, outs[1].logits)
    for layer in range(4):
        want_conv, got_conv = (c.get_conv_state(layer) for c in caches)
        want_rec, got_rec = (c.get_recurrent_state(layer) for c in caches)
        assert got_conv.shape == want_conv.shape == (1, 384, 4)
        assert got_rec.shape == want_rec.shape == (1, 4, 32, 32)
        assert got_rec.dtype == torch.float32
        # The history a step reads is the last W - 1 inputs. They are projections, which kda
        # rounds to bf16 (weights, activations and result) after layers that did the same
        # (see the module docs for the measured figures).
        np.testing.assert_allclose(got_conv[..., 1:].numpy(), want_conv[..., 1:].numpy(),
                                   rtol=0, atol=STATE_TOL * float(want_conv.abs().max()))
        np.testing.assert_allclose(got_rec.numpy(), want_rec.numpy(),
                                   rtol=0, atol=STATE_TOL * float(want_rec.abs().max()))


def test_a_cache_prefilled_by_transformers_continues_under_kda(models):
    """The conventions are transformers' own: a prefill by the unpatched model, decoded by
    the patched one, gives the logits of the patched model throughout."""
    from transformers import DynamicCache

    ref, patched = models
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    mixed, pure = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(ids, past_key_values=mixed, use_cache=True)
        patched(ids, past_key_values=pure, use_cache=True)
        token = torch.tensor([[7]])
        a = patched(token, past_key_values=mixed, use_cache=True).logits
        b = patched(token, past_key_values=pure, use_cache=True).logits
    assert_logits_close(b, a)


def test_from_weights_takes_the_transformers_config_object(models):
    ref, _ = models
    layer = kda_layers(kda.transformers.patch(copy.deepcopy(ref), schedule="serial"))[2].kda
    assert (layer.hidden_size, layer.local_heads, layer.head_dim, layer.conv_width) == \
        (128, 4, 32, 4)
    assert layer.schedule == "serial"


def test_the_transformers_layout_runs_on_torch_tensors_in_place(models):
    """`wrap_cache` on torch tensors (DLPack): kda's updates land in the engine's tensors."""
    _, patched = models
    layer = kda_layers(patched)[1].kda
    conv = torch.zeros(2, 384, 4)
    rec = torch.zeros(2, 4, 32, 32)
    own = layer.new_cache(2)
    cache = layer.wrap_cache(conv, rec, layout="transformers")
    x = torch.randn(80, 128, generator=torch.Generator().manual_seed(4))
    a = layer.forward(x, [0, 66, 80], own)
    b = layer.forward(x, [0, 66, 80], cache)
    assert np.array_equal(a, b)
    for s in range(2):
        assert np.array_equal(rec[s].transpose(1, 2).numpy(), own.recurrent_state(s))
        assert np.array_equal(conv[s, :, 1:].T.numpy(), own.conv_state(s))
