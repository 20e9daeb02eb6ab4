"""The DSpark drafter: config validation, save/load round trip through a checkpoint's `dspark/`
folder, the block pass's structure (non-causal inside a block, blind to other blocks and to
context past its anchor), Markov-head sampling, and distillation training lowering its loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.dspark import Drafter, DSparkConfig, load_drafter, save_drafter
from rollout.dspark.train import TrainConfig, build_features, distill_loss, sample_anchors, train_drafter
from rollout.native.sampler import CounterRNG

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()


def drafter_for(target, seed=0, **kw) -> Drafter:
    cfg = DSparkConfig.for_target(target.config, **{"block_size": 4, "num_layers": 1, "markov_rank": 8, **kw})
    return Drafter(cfg).init_weights(std=0.05, seed=seed).bind(target).eval()


def test_config_for_target_reads_evenly_spaced_layers_and_rejects_bad_fields(target):
    cfg = DSparkConfig.for_target(target.config)
    assert cfg.target_layer_ids == [0, 2, 3] and cfg.hidden_size == 128 and cfg.vocab_size == 512
    with pytest.raises(ValueError, match="block_size"):
        DSparkConfig.for_target(target.config, block_size=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        DSparkConfig.for_target(target.config, num_heads=3)
    with pytest.raises(ValueError, match="unknown DSparkConfig keys"):
        DSparkConfig.from_dict({**cfg.to_dict(), "blocksize": 4})
    with pytest.raises(ValueError, match="exceed"):
        Drafter(dataclasses.replace(cfg, target_layer_ids=[7])).bind(target)


def test_unbound_drafter_says_how_to_bind(target):
    d = Drafter(DSparkConfig.for_target(target.config))
    with pytest.raises(RuntimeError, match="bind"):
        _ = d.embed_tokens


def test_save_load_round_trip_gives_identical_tensors_and_drafts(target, tmp_path):
    d = drafter_for(target, seed=3)
    d.config.metadata = {"note": "round trip"}
    out = save_drafter(d, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert out == tmp_path / "ckpt" / "dspark"
    names = list(d.state_dict())
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)  # shared, not saved
    e = load_drafter(tmp_path / "ckpt", target)
    assert e.config == d.config
    for (k, a), (k2, b) in zip(d.state_dict().items(), e.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    ctx = torch.randn(2, 7, 1, 2, d.config.num_kv_heads, d.config.head_dim)
    valid = torch.arange(7) < torch.tensor([[7], [3]])
    args = (torch.tensor([5, 9]), torch.tensor([7, 3]), ctx, valid, torch.zeros(2), [None, None])
    x, y = d.draft(*args), e.draft(*args)
    assert torch.equal(x.tokens_BN, y.tokens_BN) and torch.equal(x.confidence_BN, y.confidence_BN)
    with pytest.raises(FileNotFoundError, match="no DSpark drafter"):
        load_drafter(tmp_path / "nothing", target)


def test_block_sees_its_own_block_and_context_before_its_anchor_only(target):
    d = drafter_for(target)
    S, A = 12, 2
    ctx = torch.randn(1, S, 1, 2, d.config.num_kv_heads, d.config.head_dim)
    anchors = torch.tensor([[4, 8]])
    allowed = torch.arange(S)[None, None, :] < anchors[..., None]
    ids = torch.tensor([[10, 20]])
    h = d.block_hidden(ids, anchors, ctx, allowed)
    # Changing context at or past block 0's anchor, or block 1's anchor token, leaves block 0 alone.
    ctx2 = ctx.clone()
    ctx2[:, 4:] += 1.0
    h2 = d.block_hidden(torch.tensor([[10, 21]]), anchors, ctx2, allowed)
    torch.testing.assert_close(h[:, 0], h2[:, 0])
    assert not torch.allclose(h[:, 1], h2[:, 1])
    h_one = d.block_hidden(ids[:, :1], anchors[:, :1], ctx, allowed[:, :1])
    torch.testing.assert_close(h_one[:, 0], h[:, 0])
    # Non-causal inside the block: the anchor position sees the mask positions after it.
    with torch.no_grad():
        d.mask_embedding.add_(1.0)
    h3 = d.block_hidden(ids, anchors, ctx, allowed)
    assert h3.shape == (1, A, 4, 128) and not torch.allclose(h[:, :, 0], h3[:, :, 0])


def test_markov_head_conditions_each_token_on_the_drawn_previous_one(target):
    d = drafter_for(target, markov_rank=8)
    with torch.no_grad():
        d.markov_out.weight.normal_(0, 5.0)  # a strong Markov bias
    ctx = torch.randn(1, 5, 1, 2, d.config.num_kv_heads, d.config.head_dim)
    args = (torch.tensor([7]), torch.tensor([5]), ctx, torch.ones(1, 5, dtype=torch.bool))
    out = d.draft(*args, torch.zeros(1), [None])
    U = d.base_logits(
        d.block_hidden(torch.tensor([[7]]), torch.tensor([[5]]), ctx, torch.ones(1, 1, 5, dtype=torch.bool))
    )
    prev = torch.tensor([7, *out.tokens_BN[0, :-1].tolist()])
    expect = (U[0, 0] + d.markov_out(d.markov_in(prev)).float()).argmax(-1)
    assert out.tokens_BN[0].tolist() == expect.tolist()
    sampled = d.draft(*args, torch.ones(1), [CounterRNG(0)])
    torch.testing.assert_close(sampled.probs_BNV.sum(-1), torch.ones(1, 4))
    assert (sampled.confidence_BN > 0).all() and (sampled.confidence_BN < 1).all()


def test_distillation_lowers_the_loss_on_target_generated_data(target):
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 12, (40,), generator=g)
    ]
    from rollout.dspark.train import generate_sequences

    cfg = TrainConfig(steps=40, batch_size=16, lr=3e-3, max_tokens=12, log_every=40, num_eval_seqs=8,
                      drafter={"block_size": 4, "num_layers": 1, "markov_rank": 16})  # fmt: skip
    seqs = generate_sequences(target, prompts, dataclasses.replace(cfg, samples_per_prompt=0))
    assert all(len(s) - p == 12 for s, p in seqs)
    drafter, summary = train_drafter(target, seqs, cfg, log=lambda *_: None)
    feats = build_features(target, seqs, drafter.config.target_layer_ids, torch.float32)
    anchors, valid = sample_anchors(feats, 4, torch.Generator().manual_seed(5))
    fresh = Drafter(drafter.config).init_weights(seed=cfg.seed).bind(target)
    with torch.no_grad():
        before, _ = distill_loss(fresh, feats, anchors, valid)
        after, metrics = distill_loss(drafter, feats, anchors, valid)
    assert float(after) < 0.8 * float(before)
    assert summary["final"]["accept_len_greedy"] >= 1.0 and set(metrics) == {"loss", "ce", "tv", "bce"}
