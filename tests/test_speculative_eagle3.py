"""Speculative decoding with an EAGLE-3 head (``speculative_config={"method": "eagle3", ...}``) on tiny checkpoints in
the real layouts: Llama targets of 8 layers (so that the default aux layers 2, 4 and 5 exist) and heads written as
safetensors and config.json, with d2t and t2d over a draft vocabulary of half the target's.

The engine's greedy tokens are transformers' through chunked prefill, prefix hits and preemption, every KV block back
in the pool; the head's proposals in the engine are those of a plain torch recomputation of the head (below: one
request, no paging, the whole sequence each time) from transformers' hidden states; a head built to agree with its
target has its proposals accepted; heads and targets that cannot serve are refused at start-up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from engine import LLM
from engine.config import ConfigError
from engine.worker.eagle3 import PendingStates
from tests.helpers import SMALL_CONFIG, VOCAB, save_checkpoint, spread_weights
from tests.test_engine import greedy, hf_greedy, make_prompts, run
from tests.test_speculative_draft import run_async_across_the_batch_limit

HIDDEN, INTERMEDIATE, HEADS = SMALL_CONFIG["hidden_size"], 96, 4
HEAD_DIM = HIDDEN // HEADS
TARGET_CONFIG = {**SMALL_CONFIG, "num_hidden_layers": 8}
DEFAULT_AUX = (2, 4, 5)  # (2, L // 2, L - 3) of 8 layers
DRAFT_IDS = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[: VOCAB // 2].sort().values
HEAD_LAYER = dict(model_type="llama", hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                  num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                  rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0)
EAGLE_CONFIG = dict(HEAD_LAYER, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(DRAFT_IDS))


def vocab_maps() -> dict[str, torch.Tensor]:
    """d2t (each draft id's offset to its target id) and t2d (the target ids the draft vocabulary holds)."""
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    return {"d2t": DRAFT_IDS - torch.arange(len(DRAFT_IDS)), "t2d": t2d}


def write_head(path: Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.clone().contiguous() for name, t in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def random_head_weights(kv_heads: int = 2, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return torch.empty(HIDDEN).uniform_(0.5, 1.5, generator=gen)

    kv = kv_heads * HEAD_DIM
    layer = {"self_attn.q_proj": linear(HEADS * HEAD_DIM, 2 * HIDDEN), "self_attn.k_proj": linear(kv, 2 * HIDDEN),
             "self_attn.v_proj": linear(kv, 2 * HIDDEN), "self_attn.o_proj": linear(HIDDEN, HEADS * HEAD_DIM),
             "mlp.gate_proj": linear(INTERMEDIATE, HIDDEN), "mlp.up_proj": linear(INTERMEDIATE, HIDDEN),
             "mlp.down_proj": linear(HIDDEN, INTERMEDIATE), "input_layernorm": norm(), "hidden_norm": norm(),
             "post_attention_layernorm": norm()}
    return {**{f"midlayer.{name}.weight": w for name, w in layer.items()}, "fc.weight": linear(HIDDEN, 3 * HIDDEN),
            "norm.weight": norm(), "lm_head.weight": linear(len(DRAFT_IDS), HIDDEN), **vocab_maps()}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_checkpoint(transformers.LlamaConfig(**TARGET_CONFIG), tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("head"), random_head_weights(), EAGLE_CONFIG)


# ------------------------------------------------------------------ a target whose next token a head can know

CONSTANT = 4.0  # every token's embedding has this in column 0, ~N(0, 1 / hidden) elsewhere


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory):
    """A target whose every block adds nothing (o_proj and down_proj zero): its residual stream is the token's
    embedding, so its next token is a function of the current one. Its LM head's rows outside the draft vocabulary
    are zero: its argmax (a positive logit) is always a draft token."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TARGET_CONFIG),
                                                          dtype=torch.float32).eval()
    spread_weights(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = CONSTANT
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[DRAFT_IDS] = False
        model.lm_head.weight[outside] = 0.0
    path = tmp_path_factory.mktemp("bigram")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def agreeing_head(bigram_target, tmp_path_factory):
    """An EAGLE-3 head (speculators' layout) that computes the bigram target's next token. q and k read only the
    embedding's constant column, into every rope pair: the score of a query with a key d positions back is then
    s * mean_i cos(d * theta_i), s its score with its own position's key, and ``scale`` puts the least gap between
    the two (d = 1: 6% of s with heads 16 wide) at 100 nats, so each position attends to itself only (the normed
    constant column varies by ~0.5% from token to token). v carries the normed embedding of token t + 1, o copies
    it out, the hidden input adds nothing (hidden_norm zero, before the residual), the MLP adds nothing, and the
    final norm and LM head are the target's (its draft rows): the head's argmax is the target's next token after
    token t + 1."""
    target = transformers.AutoModelForCausalLM.from_pretrained(bigram_target, dtype=torch.float32)
    inv_freq = 1.0 / HEAD_LAYER["rope_theta"] ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    gap = float((1 - torch.cos(torch.arange(1.0, 256.0)[:, None] * inv_freq).mean(-1)).min())
    normed_constant = HIDDEN * CONSTANT**2 / (CONSTANT**2 + 1)  # its square: a row's other columns add ~1
    scale = math.sqrt(100 / (normed_constant * HEAD_DIM**0.5 * gap))
    qk = torch.zeros(HEADS * HEAD_DIM, 2 * HIDDEN)
    qk[:, 0] = scale
    v = torch.zeros(HEADS * HEAD_DIM, 2 * HIDDEN)
    v[:, :HIDDEN] = torch.eye(HIDDEN)
    ones, zeros = torch.ones(HIDDEN), torch.zeros(HIDDEN)
    layer = {"self_attn.q_proj": qk, "self_attn.k_proj": qk, "self_attn.v_proj": v,
             "self_attn.o_proj": torch.eye(HIDDEN), "mlp.gate_proj": torch.zeros(INTERMEDIATE, HIDDEN),
             "mlp.up_proj": torch.zeros(INTERMEDIATE, HIDDEN), "mlp.down_proj": torch.zeros(HIDDEN, INTERMEDIATE),
             "input_layernorm": ones, "hidden_norm": zeros, "post_attention_layernorm": ones}
    weights = {**{f"layers.0.{name}.weight": w for name, w in layer.items()},
               "fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN), "norm.weight": target.model.norm.weight.detach(),
               "lm_head.weight": target.lm_head.weight.detach()[DRAFT_IDS], **vocab_maps()}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": dict(HEAD_LAYER, num_key_value_heads=HEADS),
              "draft_vocab_size": len(DRAFT_IDS), "eagle_aux_hidden_state_layer_ids": [0, 3, 7],
              "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": str(bigram_target)}}}
    return write_head(tmp_path_factory.mktemp("agreeing"), weights, config)


# ------------------------------------------------------------------ the head recomputed in plain torch


class ReferenceHead:
    """The EAGLE-3 head over one sequence, from its checkpoint and transformers' hidden states: position t takes
    the embedding of token t + 1 and fc of the target's states entering the aux layers at t; a proposal's position
    takes it and the head's own prenorm row before it. Attention over the whole sequence, recomputed each time."""

    def __init__(self, head_dir: Path, target_dir: Path, aux_layers=DEFAULT_AUX, norm_before_residual=False):
        from safetensors.torch import load_file

        weights = load_file(head_dir / "model.safetensors")
        self.w = {name.replace("layers.0.", "midlayer."): t for name, t in weights.items()}
        self.target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.aux_layers, self.norm_before_residual = aux_layers, norm_before_residual
        self.heads = self.w["midlayer.self_attn.q_proj.weight"].shape[0] // HEAD_DIM
        self.kv_heads = self.w["midlayer.self_attn.k_proj.weight"].shape[0] // HEAD_DIM

    @torch.no_grad()
    def proposals(self, tokens: list[int], k: int) -> list[int]:
        states = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [i]: layer i's input
        aux = torch.cat([states[i][0] for i in self.aux_layers], dim=-1)[:-1]  # positions 0 .. n - 2
        embed = self.target.model.embed_tokens.weight
        inputs, hidden = embed[tokens[1:]], aux @ self.w["fc.weight"].T
        out = []
        for _ in range(k):
            normed, prenorm = self.forward(inputs, hidden)
            draft = int((normed[-1] @ self.w["lm_head.weight"].T).argmax())
            out.append(draft + int(self.w["d2t"][draft]))
            inputs, hidden = torch.cat([inputs, embed[out[-1]][None]]), torch.cat([hidden, prenorm[-1:]])
        return out

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = {name.removeprefix("midlayer."): t for name, t in self.w.items()}
        n = len(embeds)
        x_hidden = _rms(hidden, w["hidden_norm.weight"])
        residual = x_hidden if self.norm_before_residual else hidden
        x = torch.cat([_rms(embeds, w["input_layernorm.weight"]), x_hidden], dim=-1)
        q = (x @ w["self_attn.q_proj.weight"].T).view(n, self.heads, HEAD_DIM)
        k = (x @ w["self_attn.k_proj.weight"].T).view(n, self.kv_heads, HEAD_DIM)
        v = (x @ w["self_attn.v_proj.weight"].T).view(n, self.kv_heads, HEAD_DIM)
        q, k = _rope(q), _rope(k)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        residual = attn @ w["self_attn.o_proj.weight"].T + residual
        x = _rms(residual, w["post_attention_layernorm.weight"])
        mlp = (F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        prenorm = mlp + residual
        return _rms(prenorm, self.w["norm.weight"]), prenorm


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + HEAD_LAYER["rms_norm_eps"])


def _rope(x: torch.Tensor) -> torch.Tensor:  # [n, heads, head_dim] at positions 0 .. n - 1, rotate-half
    inv_freq = 1.0 / HEAD_LAYER["rope_theta"] ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.arange(len(x)).float()[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None, :] for f in (torch.cos, torch.sin))
    half = HEAD_DIM // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


# ------------------------------------------------------------------ the engine


def _spec(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _record_proposals(drafter) -> list[tuple[list[int], list[int]]]:
    """Wrap the drafter's ``draft``: each drafting request's (known tokens, proposals), step after step."""
    seen, draft = [], drafter.draft

    def recording(batch, spec_token_ids):
        draft(batch, spec_token_ids)
        for rid, spec in spec_token_ids.items():
            row = batch.row_of[rid]
            n = int(batch.num_tokens[row])
            seen.append((batch.token_ids[row, :n].tolist(), batch.token_ids[row, n : n + len(spec)].tolist()))

    drafter.draft = recording
    return seen


def _assert_nothing_left(llm: LLM) -> None:
    """Every KV block back in the pool; once one more request has run, the head holds states of that one only
    (the runner forgets the others as the step after their end reports them)."""
    llm.engine.kv_manager.check_invariants()
    assert llm.engine.kv_manager.num_requests == 0
    run(llm, [[1, 2, 3]], greedy(2))
    assert len(llm.engine.runner.drafter.pending) <= 1
    assert llm.engine.runner.drafter.num_blind_drafts == 0


def test_proposals_are_the_heads_recomputed_from_transformers_hidden_states(target, random_head):
    """Three requests batched, their prompts in chunks of 16 tokens: every proposal the engine's head makes (after
    catching up on the tokens accepted since its last, and chaining on its own hidden states after the first) is
    the plain recomputation's from the same known tokens."""
    prompts = make_prompts(VOCAB, lens=[30, 11, 45], seed=1)
    with LLM(str(target), max_model_len=128, max_num_batched_tokens=16, num_kvcache_blocks=64,
             speculative_config=_spec(random_head)) as llm:
        seen = _record_proposals(llm.engine.runner.drafter)
        assert run(llm, prompts, greedy(24)) == hf_greedy(target, prompts, 24)
        _assert_nothing_left(llm)
    assert len(seen) >= 12 and any(len(proposals) == 3 for _, proposals in seen)
    reference = ReferenceHead(random_head, target)
    for tokens, proposals in seen:
        assert proposals == reference.proposals(tokens, len(proposals)), len(tokens)


def test_a_head_that_agrees_with_its_target_has_its_proposals_accepted(bigram_target, agreeing_head):
    """The constructed head (speculators' layout, its own aux layer ids) proposes the target's greedy tokens: the
    engine's tokens are transformers', nearly every proposal is accepted, in far fewer steps than tokens; its
    proposals are also the plain recomputation's."""
    prompts = make_prompts(VOCAB, lens=[12, 30, 7, 21])
    with LLM(str(bigram_target), max_model_len=256, num_kvcache_blocks=96,
             speculative_config=_spec(agreeing_head, 4)) as llm:
        seen = _record_proposals(llm.engine.runner.drafter)
        assert run(llm, prompts, greedy(20)) == hf_greedy(bigram_target, prompts, 20)
        proposer = llm.engine.proposer
        assert proposer.num_draft_tokens > 0
        assert proposer.num_accepted_tokens >= 0.95 * proposer.num_draft_tokens
        assert llm.engine.runner.drafter.aux_layers == (0, 3, 7)
        _assert_nothing_left(llm)
    reference = ReferenceHead(agreeing_head, bigram_target, (0, 3, 7), norm_before_residual=True)
    for tokens, proposals in seen[:6]:
        assert proposals == reference.proposals(tokens, len(proposals))


def test_async_scheduling_around_the_heads_proposals(bigram_target, agreeing_head):
    """Async scheduling with the head: while the batch is at ``disable_by_batch_size`` its steps are planned ahead of
    the tokens in flight (the head catches up on those tokens later); once requests end, the head proposes again.
    The tokens are transformers' greedy tokens, and the proposals made are still accepted."""
    run_async_across_the_batch_limit(bigram_target, _spec(agreeing_head, 4), _assert_nothing_left)


@pytest.mark.usefixtures("one_thread_per_rank")
def test_a_head_on_rank_0_beside_a_tp2_target(bigram_target, agreeing_head):
    """At TP=2 the head runs whole on rank 0 and embeds with the target's embeddings, gathered from both ranks at
    start-up; rank 1 verifies its proposals with the step's input ids. The tokens are transformers' greedy tokens,
    nearly every proposal is accepted, and the proposals are the plain recomputation's."""
    prompts = make_prompts(VOCAB, lens=[12, 30, 7, 21])
    with LLM(str(bigram_target), tensor_parallel_size=2, max_model_len=256, num_kvcache_blocks=96,
             speculative_config=_spec(agreeing_head, 4)) as llm:
        drafter = llm.engine.runner.drafter
        seen = _record_proposals(drafter)
        assert run(llm, prompts, greedy(20)) == hf_greedy(bigram_target, prompts, 20)
        proposer = llm.engine.proposer
        assert proposer.num_accepted_tokens >= 0.95 * proposer.num_draft_tokens > 0
        assert drafter.head.attention_layers()[0].num_heads == HEADS  # whole, beside the target's half
        assert llm.engine.runner.model.attention_layers()[0].num_heads == HEADS // 2
        assert drafter.embed_tokens.weight.shape[0] == VOCAB
        _assert_nothing_left(llm)
    reference = ReferenceHead(agreeing_head, bigram_target, (0, 3, 7), norm_before_residual=True)
    for tokens, proposals in seen[:6]:
        assert proposals == reference.proposals(tokens, len(proposals))


@pytest.mark.parametrize("pair", ["random", "agreeing"])
def test_greedy_tokens_through_chunks_prefix_hits_and_preemption(pair, request):
    """A small token budget (prefills in chunks), a pool too small for every request at once (preemptions: the head
    starts over), then one of the prompts twice (prefix-cache hits: the head starts where the target computes): the
    tokens are transformers' greedy tokens, whether the head's proposals are mostly rejected or mostly accepted."""
    target, head = (request.getfixturevalue(name) for name in
                    (("target", "random_head") if pair == "random" else ("bigram_target", "agreeing_head")))
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 55])
    expected = hf_greedy(target, prompts, 16)
    with LLM(str(target), max_model_len=128, max_num_batched_tokens=32, num_kvcache_blocks=10,
             speculative_config=_spec(head)) as llm:
        assert run(llm, prompts, greedy(16)) == expected
        assert llm.engine.stats().num_preemptions > 0
        hits = llm.engine.kv_manager.prefix_cache_hits
        for _ in range(2):
            assert run(llm, prompts[1:2], greedy(16)) == expected[1:2]
        assert llm.engine.kv_manager.prefix_cache_hits > hits
        assert llm.engine.proposer.num_drafts > 0
        _assert_nothing_left(llm)


def test_pending_states_hold_each_position_once():
    """A step's states replace those held from its first position on (a verification's rejected proposals); the
    head takes positions up to the one before the last known token; a gap starts the request over."""
    rows = torch.arange(20.0)[:, None]  # the state of position p is [p]
    pending = PendingStates(3, rows[3:5])
    pending.add(5, rows[5:9])  # a verification from position 5: 4 states, of which 2 turn out accepted
    assert [int(t) for t in torch.cat(pending.take(7))] == [3, 4, 5, 6] and pending.start == 7
    pending.add(8, rows[8:9] + 100)  # the next step starts at 8: position 7 kept, 8 replaced
    assert [int(t) for t in torch.cat(pending.take(9))] == [7, 108] and pending.size == 0
    assert pending.take(12) == []
    pending.add(11, rows[11:13])  # a gap (positions 9 and 10 never arrived): the head starts at 11
    assert pending.start == 11 and [int(t) for t in torch.cat(pending.take(20))] == [11, 12]


# ------------------------------------------------------------------ refusals


def _llm(target: Path, head: Path) -> LLM:
    return LLM(str(target), max_model_len=128, num_kvcache_blocks=32, speculative_config=_spec(head))


def test_heads_that_cannot_serve_are_refused(target, random_head, tmp_path):
    weights = random_head_weights()
    cases = {
        "not an EAGLE-3 head's": (target, {}),  # a plain Llama directory
        "no fc.weight": (None, {"drop": "fc.weight"}),
        r"vocabulary \(384 tokens\) is not the target's \(320\)": (None, {"config": {"vocab_size": VOCAB + 64}}),
        f"reads target states of {HIDDEN // 2}, the target's hidden size is {HIDDEN}": (None, {"config": {
            "target_hidden_size": HIDDEN // 2}}),
        f"fc reads {3 * HIDDEN} inputs, not 2 target states": (None, {"config": {"eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 6]}}}),
        "d2t maps draft ids outside": (None, {"d2t": torch.full((len(DRAFT_IDS),), VOCAB)}),
        "heads of one layer": (None, {"config": {"num_hidden_layers": 2}}),
    }
    for i, (message, (directory, change)) in enumerate(cases.items()):
        if directory is None:
            given = {name: t for name, t in weights.items() if name != change.get("drop")}
            if "d2t" in change:
                given["d2t"] = change["d2t"]
            directory = write_head(tmp_path / str(i), given, {**EAGLE_CONFIG, **change.get("config", {})})
        with pytest.raises(ConfigError, match=message):
            _llm(target, directory)


def test_targets_that_cannot_serve_a_head_are_refused(random_head, tmp_path):
    """A target of 4 layers has no default aux layers (2, 2, 1); a head with its own ids serves it."""
    shallow = save_checkpoint(transformers.LlamaConfig(**{**TARGET_CONFIG, "num_hidden_layers": 4}), tmp_path / "t")
    with pytest.raises(ConfigError, match=r"aux layers \[1, 2, 2\] \(the default"):
        _llm(shallow, random_head)
    named = write_head(tmp_path / "named", random_head_weights(),
                       {**EAGLE_CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}})
    with _llm(shallow, named) as llm:
        assert llm.engine.runner.drafter.aux_layers == (0, 1, 3)
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size"):
        LLM(str(shallow), speculative_config={**_spec(named), "draft_tensor_parallel_size": 2})
