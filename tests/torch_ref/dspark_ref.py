"""Torch reference implementation of the DSpark drafter, written from DESIGN.md §2, §3, §9.

It is a parity oracle for the JAX implementation and is itself checked against golden tensors produced
by the original PyTorch implementation (tests/test_torch_ref_golden.py). Everything runs in float32.

Conventions that the golden data pins down (see also the module-level notes in the test):

* Block b with anchor position p: inputs [x_p, MASK, ..., MASK] at positions p..p+T-1; block query sees
  context keys at positions j < p and all keys of its own block (bidirectional).
* Label index of output k: ``clamp(p+k+1, max=L-1)``; for dummy anchors (keep=False) it is 0.
  Aligned target index: ``max(label_index - 1, 0)`` (target head at the position that predicts the label).
* Eval mask: keep_b and p+k+1 < L and loss_mask[p+1..p+k+1] all set (prefix validity).
* Teacher forcing: previous token of output k is x_p for k=0, else the label of output k-1.
* Confidence uses the same previous token as the Markov head: [h_k ; W1[x_{k-1}]].
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

# --------------------------------------------------------------------------------------------------
# building blocks


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """positions [B, N] (int) -> cos, sin [B, N, head_dim] (rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, N, Dh]; cos/sin [B, N, Dh]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DraftAttention(nn.Module):
    """Attention with KV injection: K/V = [proj(ctx) ; proj(block)], queries from the block only."""

    def __init__(self, cfg: Qwen3Config, in_features: int | None = None):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        width = in_features or d  # what q/k/v read (Eagle3's layer: 2d)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(width, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(width, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(width, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.theta = float(_rope_theta(cfg))

    def forward(self, x, x_pos, ctx, ctx_pos, mask):
        # x [B,T,d] (normed block stream), ctx [B,S,d] (H_ctx), mask [B,T,S+T] bool (True = attend)
        B, T, _ = x.shape
        S = ctx.shape[1]
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(B, S + T, self.n_kv, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, S + T, self.n_kv, hd).transpose(1, 2)
        qc, qs = rope_cos_sin(x_pos, hd, self.theta)
        kc, ks = rope_cos_sin(torch.cat([ctx_pos, x_pos], dim=1), hd, self.theta)
        q = apply_rope(q, qc, qs)
        k = apply_rope(k, kc, ks)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(B, T, self.n_heads * hd)
        return self.o_proj(out)


class DraftLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, x_pos, ctx, ctx_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), x_pos, ctx, ctx_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Sequential head. step(h [B,d], prev [B], state) -> (bias [B,V], new_state)."""

    def __init__(self, kind: str, vocab: int, d: int, r: int):
        super().__init__()
        self.kind, self.r = kind, r
        self.markov_w1 = nn.Embedding(vocab, r)
        self.markov_w2 = nn.Linear(r, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(d + r, r, bias=True)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r, bias=True)
        elif kind != "vanilla":
            raise ValueError(f"unknown markov_head_type {kind!r}")

    def init_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.r)

    def step(self, h, prev, state):
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return self.markov_w2(g * e), state
        z = self.joint_proj(torch.cat([state, e, h], dim=-1))
        g, c, o = z.split(self.r, dim=-1)
        sg = torch.sigmoid(g)
        new_state = sg * state + (1.0 - sg) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), new_state


class ConfidenceHead(nn.Module):
    def __init__(self, d: int, r: int):
        super().__init__()
        self.proj = nn.Linear(d + r, 1, bias=True)


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        return rp["rope_theta"]
    return getattr(cfg, "rope_theta", 10000.0)


# --------------------------------------------------------------------------------------------------
# the drafter


@dataclass
class TrainOutputs:
    draft_logits: torch.Tensor        # [1, N, T, V] Markov-corrected
    base_logits: torch.Tensor         # [1, N, T, V]
    block_hidden: torch.Tensor        # [1, N, T, d]
    confidence_logits: Optional[torch.Tensor]  # [1, N, T] pre-sigmoid (None without confidence head)
    target_ids: torch.Tensor          # [1, N, T]
    eval_mask: torch.Tensor           # [1, N, T] bool
    loss_weights: torch.Tensor        # [1, N, T] exp(-k/gamma) * eval_mask
    aligned_target_logits: Optional[torch.Tensor]  # [1, N, T, V]
    loss_terms: dict


@dataclass
class ProposeOutputs:
    anchor: torch.Tensor              # [B]
    block_hidden: torch.Tensor        # [B, T, d]
    base_logits: torch.Tensor         # [B, T, V]
    draft_logits: torch.Tensor        # [B, T, V] Markov-corrected (given the sampled previous tokens)
    draft_tokens: torch.Tensor        # [B, T]
    confidence_logits: Optional[torch.Tensor]  # [B, T]


class DraftRef(nn.Module):
    def __init__(self, raw_cfg: dict):
        super().__init__()
        self.raw_cfg = raw_cfg
        cfg = Qwen3Config(**{k: v for k, v in raw_cfg.items() if k != "architectures"})
        self.cfg = cfg
        d, V = cfg.hidden_size, cfg.vocab_size
        self.block_size = int(raw_cfg["block_size"])
        self.mask_token_id = int(raw_cfg["mask_token_id"])
        self.target_layer_ids = list(raw_cfg["target_layer_ids"])
        m = len(self.target_layer_ids)
        self.markov_rank = int(raw_cfg.get("markov_rank", 0) or 0)
        self.markov_head_type = raw_cfg.get("markov_head_type", "vanilla") if self.markov_rank > 0 else None
        self.enable_confidence_head = bool(raw_cfg.get("enable_confidence_head", False))
        self.confidence_head_with_markov = bool(raw_cfg.get("confidence_head_with_markov", False)) and self.markov_rank > 0

        self.embed_tokens = nn.Embedding(V, d)
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(m * d, d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.markov_head = MarkovHead(self.markov_head_type, V, d, self.markov_rank) if self.markov_rank > 0 else None
        self.confidence_head = (
            ConfidenceHead(d, self.markov_rank if self.confidence_head_with_markov else 0)
            if self.enable_confidence_head else None
        )

    # ---- pieces -------------------------------------------------------------------------------
    def context(self, target_context_features: torch.Tensor) -> torch.Tensor:
        """[B,S,m*d] -> H_ctx [B,S,d]."""
        return self.hidden_norm(self.fc(target_context_features))

    def backbone(self, block_ids, block_pos, ctx, ctx_pos, mask) -> torch.Tensor:
        """block_ids/block_pos [B,T], ctx [B,S,d] (H_ctx), ctx_pos [B,S], mask [B,T,S+T] bool -> [B,T,d]."""
        x = self.embed_tokens(block_ids)
        for layer in self.layers:
            x = layer(x, block_pos, ctx, ctx_pos, mask)
        return self.norm(x)

    def markov_bias_teacher_forced(self, h, prev):
        """h [B,N,T,d], prev [B,N,T] -> bias [B,N,T,V] (zeros without a Markov head)."""
        if self.markov_head is None:
            return torch.zeros(*h.shape[:-1], self.cfg.vocab_size)
        B, N, T, d = h.shape
        hf, pf = h.reshape(B * N, T, d), prev.reshape(B * N, T)
        state = self.markov_head.init_state(B * N)
        out = []
        for k in range(T):
            b, state = self.markov_head.step(hf[:, k], pf[:, k], state)
            out.append(b)
        return torch.stack(out, dim=1).reshape(B, N, T, -1)

    def confidence_logits(self, h, prev):
        """h [...,d], prev [...] -> pre-sigmoid confidence [...]."""
        if self.confidence_head is None:
            return None
        feats = h
        if self.confidence_head_with_markov:
            feats = torch.cat([h, self.markov_head.markov_w1(prev)], dim=-1)
        return self.confidence_head.proj(feats)[..., 0]

    # ---- training forward ------------------------------------------------------------------------
    def train_forward(
        self,
        input_ids: torch.Tensor,                 # [1, L]
        loss_mask: torch.Tensor,                 # [1, L]
        target_context_features: torch.Tensor,   # [1, L, m*d]
        anchors: Sequence[int],
        anchor_keep: Sequence[bool],
        target_last_hidden: Optional[torch.Tensor] = None,   # [1, L, d]
        target_lm_head: Optional[torch.Tensor] = None,        # [V, d] (defaults to the drafter's lm_head)
        loss_decay_gamma: float = 4.0,
        ce_weight: float = 0.1,
        tv_weight: float = 0.9,
        confidence_weight: float = 1.0,
    ) -> TrainOutputs:
        assert input_ids.shape[0] == 1
        L, T = input_ids.shape[1], self.block_size
        N = len(anchors)
        ids, lm = input_ids[0], loss_mask[0].bool()
        p = torch.as_tensor(list(anchors), dtype=torch.long)              # [N]
        keep = torch.as_tensor(list(anchor_keep), dtype=torch.bool)       # [N]
        k = torch.arange(T)

        # labels / alignment
        raw_label = p[:, None] + k[None] + 1                              # [N,T]
        label_idx = torch.where(keep[:, None], raw_label.clamp(max=L - 1), torch.zeros_like(raw_label))
        aligned_idx = (label_idx - 1).clamp(min=0)
        target_ids = ids[label_idx]
        in_range = raw_label < L
        lm_at = lm[raw_label.clamp(max=L - 1)] & in_range
        eval_mask = keep[:, None] & (torch.cumprod(lm_at.long(), dim=1) > 0)

        # drafter backbone on all blocks at once (one sequence, block-diagonal + causal-context mask)
        block_ids = torch.full((N, T), self.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = ids[p]
        block_pos = p[:, None] + k[None]
        ctx = self.context(target_context_features)                       # [1,L,d]
        ctx_pos = torch.arange(L)[None]
        blk_of = torch.arange(N).repeat_interleave(T)                     # [N*T]
        ctx_vis = torch.arange(L)[None, :] < p[blk_of][:, None]           # [N*T, L]
        blk_vis = blk_of[:, None] == blk_of[None, :]                      # [N*T, N*T]
        mask = torch.cat([ctx_vis, blk_vis], dim=1)[None]
        h = self.backbone(block_ids.reshape(1, N * T), block_pos.reshape(1, N * T), ctx, ctx_pos, mask)
        h = h.reshape(1, N, T, -1)
        base = self.lm_head(h)

        # teacher forcing: previous token = anchor token, then the labels
        prev = torch.cat([ids[p][:, None], target_ids[:, :-1]], dim=1)[None]   # [1,N,T]
        draft = base + self.markov_bias_teacher_forced(h, prev)
        conf = self.confidence_logits(h, prev)

        aligned = None
        terms = {}
        w = torch.exp(-k.float() / loss_decay_gamma)[None, None] * eval_mask[None].float()  # [1,N,T]
        if target_last_hidden is not None:
            W = target_lm_head if target_lm_head is not None else self.lm_head.weight
            aligned = target_last_hidden[0][aligned_idx] @ W.T          # [N,T,V]
            aligned = aligned[None]
            logp_d = torch.log_softmax(draft, dim=-1)
            p_d = logp_d.exp()
            p_t = torch.softmax(aligned, dim=-1)
            ce = -logp_d.gather(-1, target_ids[None, ..., None])[..., 0]
            l1 = (p_d - p_t).abs().sum(-1)                               # plain L1 (= 2 TV)
            den = w.sum()
            terms["ce_loss_num"] = (ce * w).sum()
            terms["ce_loss_den"] = den
            terms["l1_loss_num"] = (l1 * w).sum()
            terms["l1_loss_den"] = den
            if conf is not None:
                c_star = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
                bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
                terms["confidence_loss_num"] = (bce * w).sum()
                terms["confidence_loss_den"] = den
                terms["acceptance_mean_per_pos"] = (c_star * eval_mask[None]).sum((0, 1)) / eval_mask.float().sum(0).clamp(min=1)
            else:
                terms["confidence_loss_num"] = torch.zeros(())
                terms["confidence_loss_den"] = torch.zeros(())
            safe = lambda a, b: a / b if float(b) > 0 else torch.zeros(())
            terms["loss"] = (ce_weight * safe(terms["ce_loss_num"], den)
                             + tv_weight * safe(terms["l1_loss_num"], den)
                             + confidence_weight * safe(terms["confidence_loss_num"], terms["confidence_loss_den"]))
        return TrainOutputs(draft, base, h, conf, target_ids[None], eval_mask[None], w, aligned, terms)

    # ---- one inference proposal -------------------------------------------------------------------
    def propose(
        self,
        prompt_ids: torch.Tensor,                                  # [B, n] (all prompts of length n)
        target_model=None,                                         # HF Qwen3ForCausalLM (frozen)
        target_context_features: Optional[torch.Tensor] = None,    # [B, n, m*d] instead of target_model
        anchor: Optional[torch.Tensor] = None,                     # [B] instead of target_model
        temperature: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> ProposeOutputs:
        B, n = prompt_ids.shape
        T = self.block_size
        if target_context_features is None or anchor is None:
            assert target_model is not None, "need target_model or (features, anchor)"
            feats, last_logits = target_features(target_model, prompt_ids, self.target_layer_ids)
            if target_context_features is None:
                target_context_features = feats
            if anchor is None:
                anchor = last_logits.argmax(-1)
        ctx = self.context(target_context_features)
        ctx_pos = torch.arange(n)[None].expand(B, n)
        block_ids = torch.full((B, T), self.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = anchor
        block_pos = (n + torch.arange(T))[None].expand(B, T)
        mask = torch.ones(B, T, n + T, dtype=torch.bool)  # every context key is < n; block bidirectional
        h = self.backbone(block_ids, block_pos, ctx, ctx_pos, mask)
        base = self.lm_head(h)

        prev = anchor.clone()
        state = self.markov_head.init_state(B) if self.markov_head is not None else None
        toks, logits, prevs = [], [], []
        for k in range(T):
            lk = base[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(h[:, k], prev, state)
                lk = lk + bias
            if temperature == 0.0:
                tok = lk.argmax(-1)
            else:
                tok = torch.multinomial(torch.softmax(lk / temperature, -1), 1, generator=generator)[:, 0]
            prevs.append(prev)
            toks.append(tok)
            logits.append(lk)
            prev = tok
        prevs = torch.stack(prevs, 1)
        conf = self.confidence_logits(h, prevs)
        return ProposeOutputs(anchor, h, base, torch.stack(logits, 1), torch.stack(toks, 1), conf)


# --------------------------------------------------------------------------------------------------
# loading / target helpers


_EXPECTED_CORE = (
    ["embed_tokens.weight", "norm.weight", "fc.weight", "hidden_norm.weight", "lm_head.weight"]
)


def expected_keys(raw_cfg: dict) -> set:
    keys = set(_EXPECTED_CORE)
    for i in range(int(raw_cfg["num_hidden_layers"])):
        pre = f"layers.{i}."
        keys |= {pre + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        keys |= {pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"}
        keys |= {pre + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        keys |= {pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"}
        if raw_cfg.get("attention_bias", False):
            keys |= {pre + f"self_attn.{n}_proj.bias" for n in "qkvo"}
    r = int(raw_cfg.get("markov_rank", 0) or 0)
    if r > 0:
        keys |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        kind = raw_cfg.get("markov_head_type", "vanilla")
        if kind == "gated":
            keys |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
        elif kind == "rnn":
            keys |= {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}
    if raw_cfg.get("enable_confidence_head", False):
        keys |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return keys


def load_drafter(drafter_dir) -> DraftRef:
    """Load a DeepSpec-format drafter dir (config.json + model.safetensors) as a float32 DraftRef."""
    drafter_dir = Path(drafter_dir)
    raw_cfg = json.loads((drafter_dir / "config.json").read_text())
    sd = load_file(str(drafter_dir / "model.safetensors"))
    exp = expected_keys(raw_cfg)
    missing, unexpected = exp - set(sd), set(sd) - exp
    if missing or unexpected:
        raise KeyError(f"drafter checkpoint keys mismatch: missing={sorted(missing)} unexpected={sorted(unexpected)}")
    model = DraftRef(raw_cfg)
    own = model.state_dict()
    for k_, v in sd.items():
        if tuple(own[k_].shape) != tuple(v.shape):
            raise ValueError(f"{k_}: checkpoint shape {tuple(v.shape)} != model shape {tuple(own[k_].shape)}")
    model.load_state_dict({k_: v.to(torch.float32) for k_, v in sd.items()}, strict=True)
    return model.to(torch.float32).eval()


def load_target(target_dir):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def target_features(target_model, input_ids: torch.Tensor, layer_ids: Sequence[int]):
    """Run the HF target: -> (tapped features [B,L,m*d], logits at the last position [B,V]).

    Layer id i is HF ``output_hidden_states[i + 1]`` (-1 = embedding output)."""
    out = target_model(input_ids, output_hidden_states=True)
    hs = out.hidden_states
    feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    return feats, out.logits[:, -1]
