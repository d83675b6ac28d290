"""The Transformer's invariants on a tiny random model."""
import math

import pytest
import torch

from model.config import preset
from model.transformer import Dropout, build_model, sinusoidal_table

V = 50


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return build_model(preset("tiny", "generate", V)).eval()


@pytest.fixture(scope="module")
def s2s():
    torch.manual_seed(0)
    return build_model(preset("tiny", "translate", V)).eval()


def test_positional_encoding_matches_formula():
    pe = sinusoidal_table(20, 8)
    for pos in (0, 3, 19):
        for i in range(4):
            ang = pos / 10000 ** (2 * i / 8)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(ang), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(ang), abs=1e-6)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_causal_mask_future_token_does_not_change_earlier_logits(pre_norm):
    torch.manual_seed(1)
    m = build_model(preset("tiny", "generate", V).replace(pre_norm=pre_norm)).eval()
    x = torch.randint(1, V, (2, 12))
    y = x.clone()
    y[:, 8] = (y[:, 8] + 7) % (V - 1) + 1
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-4


def test_padded_lm_batch_equals_each_alone(lm):
    seqs = [torch.randint(1, V, (n,)) for n in (5, 11, 8)]
    batch = torch.zeros(3, 11, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    out = lm(batch)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i, : len(s)], lm(s[None])[0], rtol=0, atol=1e-5)


def test_padded_translation_batch_equals_each_alone(s2s):
    srcs = [torch.randint(1, V, (n,)) for n in (4, 9, 6)]
    tgts = [torch.randint(1, V, (n,)) for n in (7, 3, 5)]
    src = torch.zeros(3, 9, dtype=torch.long)
    tgt = torch.zeros(3, 7, dtype=torch.long)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        src[i, : len(s)], tgt[i, : len(t)] = s, t
    out = s2s(src, torch.tensor([4, 9, 6]), tgt)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        alone = s2s(s[None], torch.tensor([len(s)]), t[None])[0]
        torch.testing.assert_close(out[i, : len(t)], alone, rtol=0, atol=1e-5)


def test_lm_kv_cache_equals_full_recompute(lm):
    # Right-padded prefill of different lengths, then token-by-token decode.
    lens = torch.tensor([3, 6])
    prompt = torch.randint(1, V, (2, 6))
    cont = torch.randint(1, V, (2, 5))
    caches = lm.decoder.empty_cache(2)
    logits, caches = lm.step(prompt, lens, torch.zeros(2, dtype=torch.long), caches)
    pos = lens.clone()
    for i in range(2):
        full = lm(prompt[i : i + 1, : lens[i]])[0, -1]
        torch.testing.assert_close(logits[i], full, rtol=0, atol=1e-5)
    for step in range(5):
        logits, caches = lm.step(cont[:, step : step + 1], torch.ones(2, dtype=torch.long), pos, caches)
        pos = pos + 1
        for i in range(2):
            seq = torch.cat([prompt[i, : lens[i]], cont[i, : step + 1]])
            torch.testing.assert_close(logits[i], lm(seq[None])[0, -1], rtol=0, atol=1e-5)


def test_translation_kv_cache_equals_full_recompute(s2s):
    src = torch.randint(1, V, (2, 7))
    src_len = torch.tensor([7, 4])
    tgt = torch.randint(1, V, (2, 6))
    memory = s2s.encode(src, src_len)
    cross = s2s.cross_kv(memory)
    caches = s2s.decoder.empty_cache(2)
    pos = torch.zeros(2, dtype=torch.long)
    full = s2s(src, src_len, tgt)
    for t in range(6):
        logits, caches = s2s.step(tgt[:, t : t + 1], torch.ones(2, dtype=torch.long), pos, caches, cross, src_len)
        pos = pos + 1
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-5)


def test_dropout_drops_p_of_the_elements_scales_the_rest_and_passes_gradients_through_the_mask():
    drop = Dropout(0.1).train()
    scale = 65536 / (65536 - 6554)  # p rounded to 6554 / 2^16
    x = torch.rand(1000, 1000) + 0.5  # no zeros of its own
    torch.manual_seed(0)
    y = drop(x.requires_grad_())
    zero = (y == 0).float()
    assert abs(zero.mean().item() - 0.1) < 0.002  # 1M Bernoulli draws: sd 0.0003
    # each of the four 16-bit lanes of a 64-bit draw decides on its own: every lane drops 10%, and two
    # neighbours are dropped together 1% of the time (a lane reused for several elements would give 10%)
    lanes = zero.view(-1, 4).mean(0)
    assert torch.all((lanes - 0.1).abs() < 0.004), lanes
    assert abs((zero.view(-1)[:-1] * zero.view(-1)[1:]).mean().item() - 0.01) < 0.001
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] * scale)
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() * scale)
    # seeded like every torch op: the same seed gives the same mask, another draw another one
    torch.manual_seed(0)
    assert torch.equal(drop(x.detach()), y.detach())
    assert not torch.equal(drop(x.detach()), y.detach())
    # an odd-sized, non-contiguous input keeps its shape and values where kept
    z = torch.rand(3, 5, 7).add(1).transpose(0, 2)
    out = drop(z)
    assert out.shape == z.shape and (out == 0).any() and (out != 0).any()
    torch.testing.assert_close(out[out != 0], (z * scale)[out != 0])
    # bfloat16 activations (autocast) keep their dtype and get the same (rounded) scale
    ob = drop(torch.ones(4096, dtype=torch.bfloat16))
    assert ob.dtype == torch.bfloat16 and set(ob.unique().tolist()) <= {0.0, float(torch.tensor(scale).bfloat16())}
    # eval mode and p = 0 are the identity; p must leave something to keep
    assert drop.eval()(x) is x and Dropout(0.0).train()(x) is x
    assert "p=0.1" in repr(drop)
    for bad in (1.0, -0.1, 1 - 2 ** -18):
        with pytest.raises(ValueError, match="dropout probability"):
            Dropout(bad)


def test_attention_and_activation_dropout_default_to_dropout_and_can_be_set_apart():
    from model.transformer import FeedForward, MultiHeadAttention, Residual

    def rates(cfg):
        m = build_model(cfg)
        return ({mod.dropout for mod in m.modules() if isinstance(mod, MultiHeadAttention)},
                {mod.drop.p for mod in m.modules() if isinstance(mod, FeedForward)},
                {mod.drop.p for mod in m.modules() if isinstance(mod, Residual)})

    base = preset("tiny", "translate", V).replace(dropout=0.1)
    assert rates(base) == ({0.1}, {0.1}, {0.1})  # a config saved before the two fields existed trains as before
    assert base.from_dict({k: v for k, v in base.to_dict().items()
                           if k not in ("attention_dropout", "activation_dropout")}) == base
    split = base.replace(attention_dropout=0.0, activation_dropout=0.05)
    assert rates(split) == ({0.0}, {0.05}, {0.1})
    assert type(split).from_dict(split.to_dict()) == split  # saved in checkpoints and bundle manifests
    for bad in (dict(attention_dropout=1.0), dict(activation_dropout=-0.1), dict(dropout=1.5)):
        with pytest.raises(ValueError, match="must be in"):
            base.replace(**bad)


def test_training_attention_kernel_gives_the_eval_paths_results_and_applies_attention_dropout(monkeypatch):
    """Training on the CPU runs attention through torch's math kernel; with no dropout its outputs and
    gradients are the eval path's (torch's default kernel) to float rounding."""
    import model.transformer as T

    chosen, original = [], T.sdpa_kernel

    def recording_sdpa_kernel(backend):
        chosen.append(backend)
        return original(backend)

    monkeypatch.setattr(T, "sdpa_kernel", recording_sdpa_kernel)
    torch.manual_seed(3)
    m = build_model(preset("tiny", "translate", V))  # dropout 0 everywhere
    n_attention = sum(isinstance(mod, T.MultiHeadAttention) for mod in m.modules())
    src, lens, tgt = torch.randint(4, V, (3, 7)), torch.tensor([7, 5, 2]), torch.randint(4, V, (3, 6))
    results = []
    for train in (True, False):
        m.train(train).zero_grad()
        chosen.clear()
        out = m(src, lens, tgt)
        assert chosen == ([T.SDPBackend.MATH] * n_attention if train else []), (train, chosen)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in m.parameters()]))
    (o_train, g_train), (o_eval, g_eval) = results
    torch.testing.assert_close(o_train, o_eval, rtol=0, atol=1e-5)
    for a, b in zip(g_train, g_eval):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with_attn_drop = build_model(m.cfg.replace(attention_dropout=0.3))
    with_attn_drop.load_state_dict(m.state_dict())
    with_attn_drop.train()
    assert not torch.allclose(with_attn_drop(src, lens, tgt), o_eval, atol=1e-3)
