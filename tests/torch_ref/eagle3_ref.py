"""Torch reference implementation of the Eagle3 drafter, written from DESIGN.md §3b and the Eagle3
section of the golden README (../shared/reference/golden/README.md).

A parity oracle like `tests/torch_ref/dspark_ref.py`, checked against the golden tensors of DeepSpec's
PyTorch Eagle3 (tests/test_eagle3_torch_ref.py). Everything runs in float32; the target is the Hugging
Face Qwen3 model via transformers (eager attention), tapped at ``hidden_states[i + 1]``.

What it covers:

* Loading a DeepSpec-format Eagle3 directory (``config.json`` + ``model.safetensors``, no prefix on the
  names, one decoder layer whose q/k/v read a 2d-wide input), strictly: missing, unexpected or
  misshapen tensors raise.
* The layer: q/k/v from [input_layernorm(token embedding); hidden_norm(incoming hidden)], Qwen3
  attention (per-head q/k RMS norms, RoPE with the target's theta, grouped KV heads, scale
  head_dim^-1/2), the attention output added to the un-normed incoming hidden state, then the
  post-attention-normed SwiGLU MLP residual. The layer output is the next hidden state; logits are
  ``lm_head(norm(h))``. A committed position's incoming hidden state is ``fc(target features)``.
* The training forward over the TTT horizon (`Eagle3Ref.ttt_forward`): per step k the fed tokens
  (``input_ids[t+1+k]``, 0 past the end), the RoPE positions t+k, the layer outputs and the logits.
  A query at step k, position t, sees the step-0 keys of positions 0..t and, of each step 1..k, the key
  of its own position t; queries with t >= valid length - k see nothing (zero attention output).
* The TTT targets and loss (`ttt_target_probs`, `ttt_position_mask`, `ttt_loss`): soft targets (the
  target's softmax at t+1+k, uniform past the end), the shifted position mask, per-position soft
  cross-entropy, per-step numerators / denominators (batch x sequence length), 0.8^k step weights and
  the total; DeepSpec's logged metrics (accuracy, accept rate, counted positions, both tau estimates).
* Greedy inference (`Eagle3Cache`, `prefill`, `propose`, `verify_greedy`, `commit`): prefill of the
  drafter's cache with the prompt's features paired with the prompt shifted by one (then the anchor),
  the chain of ``ttt_length`` drafts (tokens, logits, the hidden state behind each logits row and its
  position), one greedy target verification (accepted count, committed tokens, their features), the
  cache cut back and extended with the committed rows (no causal mask among them), and the next chain.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
from safetensors.torch import load_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from tests.torch_ref.dspark_ref import DraftAttention, apply_rope, load_target, rope_cos_sin

__all__ = [
    "Eagle3Ref", "Eagle3Cache", "TTTOutputs", "ChainOutputs", "load_eagle3_ref", "load_target",
    "target_outputs", "ttt_step_input_ids", "ttt_rope_positions", "ttt_target_probs", "ttt_position_mask",
    "ttt_loss", "verify_greedy",
]

# --------------------------------------------------------------------------------------------------
# the layer


class Eagle3Attention(DraftAttention):
    """Qwen3 attention whose q/k/v read the 2d-wide [normed embedding; normed hidden] input."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg, in_features=2 * cfg.hidden_size)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """x [B,T,2d], pos [B,T] -> rotated q [B,H,T,hd], rotated k [B,KV,T,hd], v [B,KV,T,hd]."""
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(pos, hd, self.theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B,KV,N,hd] -> [B,H,N,hd] (query head h reads KV head h // (H / KV))."""
        return x.repeat_interleave(self.n_heads // self.n_kv, dim=1)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        d = cfg.hidden_size
        self.hidden_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.input_layernorm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """Token embeddings and incoming hidden states [B,T,d] at positions [B,T] -> q, k, v."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.qkv(x, pos)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """hidden [B,T,d], attention output [B,H,T,hd] -> the layer output (the next hidden state)."""
        B, H, T, hd = attn.shape
        h = hidden + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, H * hd))
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------------------------------
# outputs / cache


@dataclass
class TTTOutputs:
    step_input_ids: torch.Tensor      # [B, K, S] token fed at step k, position t
    rope_positions: torch.Tensor      # [B, K, S]
    hidden: torch.Tensor              # [B, K, S, d] layer output of step k (behind its logits)
    logits: torch.Tensor              # [B, K, S, V]


@dataclass
class ChainOutputs:
    tokens: torch.Tensor              # [B, K] greedy drafts
    logits: torch.Tensor              # [B, K, V]
    hidden: torch.Tensor              # [B, K, d] hidden state behind each logits row
    positions: torch.Tensor           # [B, K] its position


class Eagle3Cache:
    """The draft layer's keys (normed, rotated) and values, [B, KV, N, hd]; row s at position s."""

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def truncate(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


# --------------------------------------------------------------------------------------------------
# the drafter


def ttt_step_input_ids(input_ids: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """[B,S] -> [B,K,S]: token t+1+k at step k, position t (0 once past the end)."""
    S = input_ids.shape[1]
    idx = torch.arange(S)[None] + 1 + torch.arange(ttt_length)[:, None]       # [K,S]
    tok = input_ids[:, idx.clamp(max=S - 1)]
    return torch.where(idx[None] < S, tok, torch.zeros_like(tok))


def ttt_rope_positions(batch: int, seq_len: int, ttt_length: int) -> torch.Tensor:
    """[B,K,S]: position t + k."""
    pos = torch.arange(seq_len)[None] + torch.arange(ttt_length)[:, None]
    return pos[None].expand(batch, ttt_length, seq_len).clone()


class Eagle3Ref(nn.Module):
    def __init__(self, raw_cfg: dict):
        super().__init__()
        self.raw_cfg = raw_cfg
        cfg = Qwen3Config(**{k: v for k, v in raw_cfg.items() if k != "architectures"})
        self.cfg = cfg
        d, V = cfg.hidden_size, cfg.vocab_size
        self.target_layer_ids = list(raw_cfg["target_layer_ids"])
        self.ttt_length = int(raw_cfg.get("ttt_length", 7))
        self.step_loss_decay = float(raw_cfg.get("step_loss_decay", 0.8))
        m = len(self.target_layer_ids)
        self.embed_tokens = nn.Embedding(V, d)
        self.fc = nn.Linear(m * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, V, bias=False)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """[B,S,m*d] -> [B,S,d]: fc, no norm (hidden_norm sits inside the layer)."""
        return self.fc(target_features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # ---- training forward (TTT) -----------------------------------------------------------------
    def ttt_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    target_context_features: torch.Tensor, ttt_length: Optional[int] = None) -> TTTOutputs:
        """input_ids/attention_mask [B,S] (right-padded), target_context_features [B,S,m*d]."""
        K = self.ttt_length if ttt_length is None else int(ttt_length)
        B, S = input_ids.shape
        attn = self.layer.self_attn
        scale = 1.0 / math.sqrt(attn.head_dim)
        valid_len = attention_mask.long().sum(-1)                             # [B]
        t = torch.arange(S)
        causal = t[None, :] <= t[:, None]                                     # [S(query), S(key)]
        step_ids = ttt_step_input_ids(input_ids, K)
        positions = ttt_rope_positions(B, S, K)

        h = self.project(target_context_features)
        k0 = v0 = None
        own_k, own_v = [], []   # steps 1..k: [B,H,S,hd], each query reads only its own position
        hiddens, logits = [], []
        for k in range(K):
            q, kk, vv = self.layer.qkv(self.embed_tokens(step_ids[:, k]), h, positions[:, k])
            kk, vv = attn.expand_kv(kk), attn.expand_kv(vv)
            if k == 0:
                k0, v0 = kk, vv
            else:
                own_k.append(kk)
                own_v.append(vv)
            q_valid = t[None] < (valid_len[:, None] - k)                       # [B,S]
            s0 = (q @ k0.transpose(-1, -2)) * scale                             # [B,H,S,S]
            s0 = s0.masked_fill(~causal[None, None], float("-inf"))
            parts = [s0] + [((q * kj).sum(-1) * scale)[..., None] for kj in own_k]   # [B,H,S,1] each
            scores = torch.cat(parts, dim=-1)
            # rows of invalid queries: any finite scores, their output is zeroed below
            scores = scores.masked_fill(~q_valid[:, None, :, None], 0.0)
            probs = torch.softmax(scores, dim=-1)
            out = probs[..., :S] @ v0
            for j, vj in enumerate(own_v):
                out = out + probs[..., S + j, None] * vj
            out = out * q_valid[:, None, :, None]
            h = self.layer.finish(h, out)
            hiddens.append(h)
            logits.append(self.logits(h))
        return TTTOutputs(step_ids, positions, torch.stack(hiddens, 1), torch.stack(logits, 1))

    # ---- inference --------------------------------------------------------------------------------
    def run_rows(self, cache: Eagle3Cache, tokens: torch.Tensor, hidden: torch.Tensor,
                 positions: torch.Tensor, causal: bool) -> torch.Tensor:
        """Rows (token [B,T], incoming hidden [B,T,d]) at positions [B,T] through the layer; they see the
        whole cache and each other (causally or not), and are appended to it. -> outputs [B,T,d]."""
        attn = self.layer.self_attn
        q, k, v = self.layer.qkv(self.embed_tokens(tokens), hidden, positions)
        n, T = len(cache), tokens.shape[1]
        cache.append(k, v)
        keys, vals = attn.expand_kv(cache.k), attn.expand_kv(cache.v)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(attn.head_dim)    # [B,H,T,n+T]
        if causal:
            j = torch.arange(n + T)
            visible = j[None, :] <= (n + torch.arange(T))[:, None]
            scores = scores.masked_fill(~visible[None, None], float("-inf"))
        return self.layer.finish(hidden, torch.softmax(scores, dim=-1) @ vals)

    def prefill(self, cache: Eagle3Cache, prompt_ids: torch.Tensor, prompt_features: torch.Tensor,
                anchor: torch.Tensor) -> torch.Tensor:
        """Prompt features [B,n,m*d] paired with the prompt shifted by one (then the anchor), positions
        0..n-1, causal. -> the output at the last position [B,d], which starts the chain."""
        B, n = prompt_ids.shape
        tokens = torch.cat([prompt_ids[:, 1:], anchor.reshape(B, 1)], dim=1)
        pos = torch.arange(n)[None].expand(B, n)
        return self.run_rows(cache, tokens, self.project(prompt_features), pos, causal=True)[:, -1]

    def propose(self, cache: Eagle3Cache, hidden: torch.Tensor, position: torch.Tensor,
                length: Optional[int] = None) -> ChainOutputs:
        """Greedy chain from hidden [B,d] at position [B]: logits from the current hidden state, the
        argmax is drafted, then one row (that token, the current hidden state) at the next position
        gives the next hidden state. The cache keeps the chain's rows (cut it back before committing)."""
        K = self.ttt_length if length is None else int(length)
        pos = position.clone().long()
        toks, logits, hiddens, positions = [], [], [], []
        for i in range(K):
            lg = self.logits(hidden)
            tok = lg.argmax(-1)
            toks.append(tok)
            logits.append(lg)
            hiddens.append(hidden)
            positions.append(pos)
            if i + 1 < K:
                pos = pos + 1
                hidden = self.run_rows(cache, tok[:, None], hidden[:, None], pos[:, None], causal=True)[:, 0]
        st = lambda xs: torch.stack(xs, 1)
        return ChainOutputs(st(toks), st(logits), st(hiddens), st(positions))

    def commit(self, cache: Eagle3Cache, keep: int, tokens: torch.Tensor, features: torch.Tensor,
               start: int) -> torch.Tensor:
        """Cut the cache back to `keep` rows and extend it with the committed tokens [B,c] paired with
        the verified rows' target features [B,c,m*d] at positions start.. (no causal mask among them).
        -> the last row's output [B,d] (exact for one layer), which starts the next chain."""
        cache.truncate(keep)
        B, c = tokens.shape
        pos = (start + torch.arange(c))[None].expand(B, c)
        return self.run_rows(cache, tokens, self.project(features), pos, causal=False)[:, -1]


# --------------------------------------------------------------------------------------------------
# targets, masks and loss (TTT)


def ttt_target_probs(target_logits: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """[B,S,V] -> [B,K,S,V]: softmax of the target logits at t+1+k (uniform where t+1+k >= S)."""
    B, S, V = target_logits.shape
    probs = torch.softmax(target_logits.float(), dim=-1)
    idx = torch.arange(S)[None] + 1 + torch.arange(ttt_length)[:, None]      # [K,S]
    out = probs[:, idx.clamp(max=S - 1)]
    return torch.where((idx < S)[None, ..., None], out, torch.full_like(out, 1.0 / V))


def ttt_position_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """[B,S] -> [B,K,S] bool: the loss mask (within the valid length) with the last valid position
    cleared, shifted left by k with zero fill."""
    B, S = loss_mask.shape
    valid_len = attention_mask.long().sum(-1)
    t = torch.arange(S)
    base = loss_mask.bool() & (t[None] < (valid_len[:, None] - 1))
    idx = t[None] + torch.arange(ttt_length)[:, None]                         # [K,S]
    out = base[:, idx.clamp(max=S - 1)]
    return out & (idx < S)[None]


def ttt_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor, position_mask: torch.Tensor,
             step_loss_decay: float) -> dict:
    """Per-position soft CE, per-step terms, the total, and DeepSpec's logged metrics."""
    B, K, S, _ = draft_logits.shape
    m = position_mask.float()
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    ce = -(target_probs * logp).sum(-1) * m                                   # [B,K,S]
    num = ce.sum((0, 2))
    den = torch.full((K,), float(B * S))
    step_loss = num / den
    weight = torch.tensor([step_loss_decay ** k for k in range(K)], dtype=torch.float64)
    correct = (draft_logits.argmax(-1) == target_probs.argmax(-1)).float() * m
    accept = (1.0 - 0.5 * (logp.exp() - target_probs).abs().sum(-1)).clamp(0.0, 1.0) * m
    counted0 = m[:, 0]
    tau = lambda x: ((1.0 + torch.cumprod(x, dim=1).sum(1)) * counted0).sum()
    return dict(
        step_ce=ce, step_ce_num=num, step_den=den, step_loss=step_loss, step_weight=weight,
        total_loss=(weight * step_loss.double()).sum(),
        accuracy_num=correct.sum((0, 2)), accept_rate_num=accept.sum((0, 2)), valid_tokens=m.sum((0, 2)),
        tau_greedy_num=tau(correct), tau_probabilistic_num=tau(accept), tau_den=counted0.sum(),
    )


# --------------------------------------------------------------------------------------------------
# loading / target helpers


def expected_keys(raw_cfg: dict) -> dict:
    """Checkpoint key -> shape (torch layout) of a DeepSpec Eagle3 drafter."""
    d, V = int(raw_cfg["hidden_size"]), int(raw_cfg["vocab_size"])
    H, KV = int(raw_cfg["num_attention_heads"]), int(raw_cfg["num_key_value_heads"])
    hd = int(raw_cfg.get("head_dim") or d // H)
    inter, m = int(raw_cfg["intermediate_size"]), len(raw_cfg["target_layer_ids"])
    shapes = {"embed_tokens.weight": (V, d), "fc.weight": (d, m * d), "norm.weight": (d,),
              "lm_head.weight": (V, d)}
    pre = "layers.0."
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        shapes[pre + n + ".weight"] = (d,)
    shapes.update({pre + "self_attn.q_proj.weight": (H * hd, 2 * d), pre + "self_attn.k_proj.weight": (KV * hd, 2 * d),
                   pre + "self_attn.v_proj.weight": (KV * hd, 2 * d), pre + "self_attn.o_proj.weight": (d, H * hd),
                   pre + "self_attn.q_norm.weight": (hd,), pre + "self_attn.k_norm.weight": (hd,),
                   pre + "mlp.gate_proj.weight": (inter, d), pre + "mlp.up_proj.weight": (inter, d),
                   pre + "mlp.down_proj.weight": (d, inter)})
    if raw_cfg.get("attention_bias", False):
        shapes.update({pre + "self_attn.q_proj.bias": (H * hd,), pre + "self_attn.k_proj.bias": (KV * hd,),
                       pre + "self_attn.v_proj.bias": (KV * hd,), pre + "self_attn.o_proj.bias": (d,)})
    return shapes


def load_eagle3_ref(drafter_dir) -> Eagle3Ref:
    """Load a DeepSpec-format Eagle3 dir (config.json + model.safetensors) as a float32 Eagle3Ref."""
    drafter_dir = Path(drafter_dir)
    raw_cfg = json.loads((drafter_dir / "config.json").read_text())
    if "Qwen3Eagle3Model" not in (raw_cfg.get("architectures") or []):
        raise ValueError(f"{drafter_dir}: not a DeepSpec Eagle3 drafter ({raw_cfg.get('architectures')})")
    layers = raw_cfg.get("draft_num_hidden_layers", raw_cfg.get("num_hidden_layers"))
    if layers != 1:
        raise ValueError(f"{drafter_dir}: {layers} draft layers; DeepSpec's Eagle3 has exactly one")
    sd = load_file(str(drafter_dir / "model.safetensors"))
    exp = expected_keys(raw_cfg)
    missing, unexpected = set(exp) - set(sd), set(sd) - set(exp)
    if missing or unexpected:
        raise KeyError(f"Eagle3 checkpoint keys mismatch: missing={sorted(missing)} unexpected={sorted(unexpected)}")
    for k, v in sd.items():
        if tuple(v.shape) != exp[k]:
            raise ValueError(f"{k}: checkpoint shape {tuple(v.shape)} != expected {exp[k]}")
    model = Eagle3Ref(raw_cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.to(torch.float32).eval()


@torch.no_grad()
def target_outputs(target_model, input_ids: torch.Tensor, layer_ids: Sequence[int]):
    """Run the HF target: -> (tapped features [B,L,m*d], final normed hidden [B,L,d], logits [B,L,V]).

    Layer id i is HF ``output_hidden_states[i + 1]``."""
    out = target_model(input_ids, output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1), hs[-1], out.logits


@torch.no_grad()
def verify_greedy(target_model, prefix_ids: torch.Tensor, anchor: torch.Tensor, drafts: torch.Tensor,
                  layer_ids: Sequence[int]):
    """One temperature-0 verification of [anchor, drafts] after prefix_ids [1,n] (a full forward, no
    cache). -> (accepted count, committed tokens [1,a+1] (accepted drafts, then the target's own token),
    the target features of the verified rows [1,a+1,m*d] (the anchor's, then the accepted drafts'))."""
    assert prefix_ids.shape[0] == 1
    n, K = prefix_ids.shape[1], drafts.shape[1]
    seq = torch.cat([prefix_ids, anchor.reshape(1, 1), drafts], dim=1)
    feats, _, logits = target_outputs(target_model, seq, layer_ids)
    target_next = logits[0, n:].argmax(-1)                                     # [K+1]
    accepted = int(torch.cumprod((drafts[0] == target_next[:K]).long(), 0).sum())
    committed = torch.cat([drafts[0, :accepted], target_next[accepted:accepted + 1]])[None]
    return accepted, committed, feats[:, n:n + accepted + 1]
