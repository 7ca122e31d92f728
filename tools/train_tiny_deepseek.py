#!/usr/bin/python3
"""Trains a small DeepSeek-V3-architecture model on CPU and writes a checkpoint Tandem loads.

Random-weight checkpoints (`tandem make-model`) exercise every code path but predict nothing, so
speculative decoding with them accepts no drafts and sampled text is noise. This script trains the
same architecture, MTP module included, on text that Debian ships (the Python standard library's
sources), deterministically, in about 25 minutes on 2 cores:

    /usr/bin/python3 tools/train_tiny_deepseek.py train [--preset default|tiny] [--steps N]
        [--out DIR] [--seed S] [--dtype bf16|f32] [--tandem PATH]
    /usr/bin/python3 tools/train_tiny_deepseek.py forward --model DIR --request REQ --out OUT
    /usr/bin/python3 tools/train_tiny_deepseek.py held-out --out FILE

`train` writes DIR (default ~/.cache/tandem/models/tiny-trained-v3) in the Hugging Face layout:
config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
training_log.json (settings, losses, corpus digest). `forward` loads such a folder into this
script's own model and answers the request format of tests/oracle/deepseek_reference.py
({"sequences", "all_logits", "greedy_tokens", "mtp"} -> {"sequences": [{"logits", "greedy",
"mtp_logits"}]}), so tests compare Tandem's forward pass with the trainer's. `held-out` writes the
text of the source files that training leaves out (every 20th), for benchmarks' prompts.

Architecture (DeepSeek-V3 as Tandem implements it): MLA attention with q-LoRA, RoPE on
consecutive pairs of the rope part (no YaRN), RMSNorm, dense FFNs in the first
first_k_dense_replace layers, then DeepSeekMoE with sigmoid scores, noaux_tc group-limited top-k
whose correction bias only selects, normalised top-k weights times routed_scaling_factor, and a
shared expert; one MTP module at layer index num_hidden_layers:
eh_proj([enorm(embed(t[i+1])) ; hnorm(h[i])]) -> one decoder layer -> shared_head, predicting
t[i+2]. As in DeepSeek-V3, the MTP module shares the main model's embedding and output head during
training; the checkpoint holds copies under the MTP layer's names.

Training: next-token loss + 0.3 x MTP loss + a tiny sequence-wise balance loss; the correction
biases follow DeepSeek-V3's auxiliary-loss-free rule (bias += gamma * sign(mean load - load) per
step, no gradient). AdamW, warm-up then cosine decay, gradient clipping.

Speed on a 2-core CPU without a fast BLAS (Debian's torch uses the reference BLAS, ~2 GFLOP/s):
matrix products go through oneDNN (torch's mkldnn_linear, ~10x faster), and the 129,280-row
output layer, which would be ~95% of the work, is trained with one row per frequent token only
(the 12,287 most frequent tokens of the training text: 99% of it). All other tokens share one
embedding row and one output row; the softmax counts that output row once per such token, so the
training loss is the exact full-vocabulary loss of the exported model, in which those tokens all
get the shared rows (equal logits, which training keeps low).

Determinism: the same seed, corpus, thread count and machine give the same checkpoint
(torch.manual_seed, a fixed data order, torch.use_deterministic_algorithms; oneDNN's products do
not depend on timing but may differ between CPUs and thread counts).
"""
import argparse
import functools
import glob
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time

# Spinning OpenMP workers of torch and oneDNN stall each other when another process takes a
# core (measured: 30x slower steps beside a compiler); waiting passively costs little. It must be
# set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO, "tests", "oracle", "node_modules", "@lenml",
                             "tokenizer-deepseek_v3", "models")
DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "models", "tiny-trained-v3")
VOCAB_SIZE = 129280  # DeepSeek-V3's embedding rows: the tokenizer's 128,815 ids, padded
BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"


class TrainError(Exception):
    """A problem with the inputs or the environment, reported in one line."""


# ------------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------------

# Model shape (config.json fields) and training settings. `default` is sized to train in about 25
# minutes on 2 cores; `tiny` trains a few steps in seconds, for tests.
PRESETS = {
    "default": {
        "model": dict(hidden_size=128, num_hidden_layers=4, first_k_dense_replace=1,
                      num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32, intermediate_size=384,
                      moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
                      num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        "train": dict(steps=330, batch=16, seq_len=256, lr=3e-3, warmup=30, corpus_mb=12.0,
                      train_vocab=12288, eval_chunks=64),
    },
    "tiny": {
        "model": dict(hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1,
                      num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                      moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        "train": dict(steps=20, batch=4, seq_len=64, lr=3e-3, warmup=5, corpus_mb=0.1,
                      train_vocab=32768, eval_chunks=4),
    },
}


def model_config(shape, bos_id, eos_id, dtype):
    """config.json: every field Tandem's parser (src/model/config.cpp) requires, the rest as
    DeepSeek-V3's release spells them."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.0001,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "ep_size": 1,
        "first_k_dense_replace": shape["first_k_dense_replace"],
        "hidden_act": "silu",
        "hidden_size": shape["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": shape["intermediate_size"],
        "kv_lora_rank": shape["kv_lora_rank"],
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": shape["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": shape["n_group"],
        "n_routed_experts": shape["n_routed_experts"],
        "n_shared_experts": shape["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": shape["num_attention_heads"],
        "num_experts_per_tok": shape["num_experts_per_tok"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_key_value_heads": shape["num_attention_heads"],
        "num_nextn_predict_layers": 1,
        "pretraining_tp": 1,
        "q_lora_rank": shape["q_lora_rank"],
        "qk_nope_head_dim": shape["qk_nope_head_dim"],
        "qk_rope_head_dim": shape["qk_rope_head_dim"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": shape["routed_scaling_factor"],
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": shape["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": {"bf16": "bfloat16", "f32": "float32"}[dtype],
        "transformers_version": "4.46.3",
        "use_cache": True,
        "v_head_dim": shape["v_head_dim"],
        "vocab_size": VOCAB_SIZE,
    }


class Shape:
    """The config.json fields the forward pass reads, checked for what this script implements."""

    def __init__(self, cfg, origin):
        def need(key):
            if key not in cfg:
                raise TrainError(f"{origin}: field {key} is missing")
            return cfg[key]
        if need("architectures") != ["DeepseekV3ForCausalLM"]:
            raise TrainError(f"{origin}: architectures must be [\"DeepseekV3ForCausalLM\"]")
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                          ("norm_topk_prob", True), ("moe_layer_freq", 1), ("rope_scaling", None),
                          ("tie_word_embeddings", False), ("num_nextn_predict_layers", 1)):
            if cfg.get(key, want) != want:
                raise TrainError(f"{origin}: field {key} must be {json.dumps(want)} here")
        if need("q_lora_rank") is None:
            raise TrainError(f"{origin}: q_lora_rank null (no q-LoRA) is not implemented here")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace",
                    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
                    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                    "topk_group", "routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            setattr(self, key, need(key))


# ------------------------------------------------------------------------------------------------
# matrix products through oneDNN
# ------------------------------------------------------------------------------------------------

_MKLDNN_LINEAR = getattr(torch._C._nn, "mkldnn_linear", None)
USE_ONEDNN = _MKLDNN_LINEAR is not None and torch.backends.mkldnn.is_available()


def mm_nt(a, b):
    """a [m, k] @ b [n, k]^T in float32. Debian's torch multiplies through the reference BLAS at
    ~2 GFLOP/s; oneDNN's inner-product primitive (mkldnn_linear) reaches 20-45 on the same core."""
    if USE_ONEDNN:
        return _MKLDNN_LINEAR(a.to_mkldnn(), b.to_mkldnn()).to_dense()
    return a @ b.t()


class _LinearFn(torch.autograd.Function):
    """y = x W^T with all three products (forward, input and weight gradients) through mm_nt."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return mm_nt(x, w)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = mm_nt(gy, w.t()) if ctx.needs_input_grad[0] else None
        gw = mm_nt(gy.t(), x.t()) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x, w):
    shape = x.shape
    return _LinearFn.apply(x.reshape(-1, shape[-1]), w).view(*shape[:-1], w.shape[0])


class _BatchedFn(torch.autograd.Function):
    """y[i] = a[i] @ b[i]^T for a [n, m, k], b [n, p, k]: attention's products, one mm_nt each
    (the reference BLAS's batched product was half of a training step's time)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.stack([mm_nt(a[i], b[i]) for i in range(a.shape[0])])

    @staticmethod
    def backward(ctx, gy):
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = torch.stack([mm_nt(gy[i], b[i].t()) for i in range(a.shape[0])])
        if ctx.needs_input_grad[1]:
            gb = torch.stack([mm_nt(gy[i].t(), a[i].t()) for i in range(a.shape[0])])
        return ga, gb


def batched_nt(a, b):
    """a [..., m, k] @ b [..., p, k]^T."""
    lead = a.shape[:-2]
    out = _BatchedFn.apply(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*lead, a.shape[-2], b.shape[-2])


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------

class Linear(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x):
        return linear(x, self.weight)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(dim, theta, length):
    """cos, sin [length, dim / 2]: pair i of a vector at position p turns by p * theta^(-2i/dim),
    computed in float64 so that long positions keep their precision."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (torch.from_numpy(np.cos(angles).astype(np.float32)),
            torch.from_numpy(np.sin(angles).astype(np.float32)))


def apply_rope(x, cos, sin):
    """DeepSeek's layout: consecutive pairs (x[2i], x[2i+1]) rotate, not the two halves.
    x [..., T, (heads,) dim]; cos/sin broadcast to [..., T, (heads,) dim / 2]."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(torch.nn.Module):
    """Multi-head latent attention, computed in the expanded ("naive") form: training has no cache,
    so rebuilding per-head keys and values from the latent is the cheaper order."""

    def __init__(self, s):
        super().__init__()
        self.heads, self.dn, self.dr, self.dv = (s.num_attention_heads, s.qk_nope_head_dim,
                                                 s.qk_rope_head_dim, s.v_head_dim)
        self.r = s.kv_lora_rank
        h, hd = s.hidden_size, s.qk_nope_head_dim + s.qk_rope_head_dim
        self.q_a_proj = Linear(h, s.q_lora_rank)
        self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
        self.q_b_proj = Linear(s.q_lora_rank, self.heads * hd)
        self.kv_a_proj_with_mqa = Linear(h, self.r + self.dr)
        self.kv_a_layernorm = RMSNorm(self.r, s.rms_norm_eps)
        self.kv_b_proj = Linear(self.r, self.heads * (self.dn + self.dv))
        self.o_proj = Linear(self.heads * self.dv, h)
        self.scale = hd ** -0.5

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.heads, -1)
        q_rope = apply_rope(q[..., self.dn:], cos[:, None, :], sin[:, None, :])
        kv_a = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv_a[..., :self.r])
        k_rope = apply_rope(kv_a[..., self.r:], cos, sin)  # one rope key, shared by every head
        kv = self.kv_b_proj(latent).view(b, t, self.heads, self.dn + self.dv)
        k = torch.cat([kv[..., :self.dn], k_rope[:, :, None, :].expand(b, t, self.heads, self.dr)],
                      dim=-1)
        q = torch.cat([q[..., :self.dn], q_rope], dim=-1)
        scores = batched_nt(q.transpose(1, 2), k.transpose(1, 2)) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        out = batched_nt(probs, kv[..., self.dn:].permute(0, 2, 3, 1))  # [b, heads, t, dv]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.dv))


class Mlp(torch.nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = Linear(hidden, inter)
        self.up_proj = Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(torch.nn.Module):
    """DeepSeek-V3's gate: sigmoid scores; experts chosen by score + e_score_correction_bias within
    the topk_group groups whose two best biased scores sum highest; weights are the unbiased
    scores of the chosen experts, normalised to sum 1, times routed_scaling_factor."""

    def __init__(self, s):
        super().__init__()
        self.experts, self.top_k = s.n_routed_experts, s.num_experts_per_tok
        self.n_group, self.topk_group = s.n_group, s.topk_group
        self.scaling = s.routed_scaling_factor
        self.weight = torch.nn.Parameter(torch.empty(self.experts, s.hidden_size))
        # Trained by the load-balancing rule, not by gradients (DeepSeek-V3 section 2.1.2).
        self.register_buffer("e_score_correction_bias", torch.zeros(self.experts))

    def forward(self, x):
        scores = torch.sigmoid(linear(x, self.weight))
        choice = scores.detach() + self.e_score_correction_bias
        if self.n_group > 1:
            n = choice.shape[0]
            grouped = choice.view(n, self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            excluded = torch.ones(n, self.n_group, dtype=torch.bool).scatter_(1, keep, False)
            choice = grouped.masked_fill(excluded[..., None], float("-inf")).view(n, -1)
        top = choice.topk(self.top_k, dim=-1)
        weights = scores.gather(1, top.indices)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.scaling
        return scores, top.indices, weights


class Moe(torch.nn.Module):
    def __init__(self, s):
        super().__init__()
        self.gate = Router(s)
        self.experts = torch.nn.ModuleList(Mlp(s.hidden_size, s.moe_intermediate_size)
                                           for _ in range(s.n_routed_experts))
        self.shared_experts = Mlp(s.hidden_size, s.moe_intermediate_size * s.n_shared_experts)
        self.load = None         # tokens per expert in the last forward (for the bias update)
        self.balance_loss = None  # the sequence-wise balance term of the last forward

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        scores, chosen, weights = self.gate(flat)
        out = self.shared_experts(flat)
        # One gather and scatter per expert, which keeps each expert's products dense.
        for e in range(len(self.experts)):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                y = self.experts[e](flat[rows]) * weights[rows, slot, None]
                out = out.index_add(0, rows, y)
        if self.training:
            e = len(self.experts)
            counts = torch.zeros(b, e).scatter_add_(
                1, chosen.view(b, -1), torch.ones(b, chosen.shape[1] * t))
            self.load = counts.sum(0)
            # DeepSeek-V3's L_Bal per sequence: sum_i f_i P_i with f_i = E / (K T) * (tokens sent
            # to expert i) and P_i = the mean of its normalised score.
            frac = counts * (e / (chosen.shape[1] * t))
            p = (scores / scores.sum(-1, keepdim=True)).view(b, t, e).mean(1)
            self.balance_loss = (frac * p).sum(-1).mean()
        return out.view(b, t, h)


class DecoderLayer(torch.nn.Module):
    def __init__(self, s, index):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = (Moe(s) if index >= s.first_k_dense_replace
                    else Mlp(s.hidden_size, s.intermediate_size))

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(torch.nn.Module):
    def __init__(self, s):
        super().__init__()
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class MtpLayer(DecoderLayer):
    """The MTP module, stored as model.layers.{num_hidden_layers}: its own norms and eh_proj around
    a decoder layer; the embedding and output head are the main model's (copied on export)."""

    def __init__(self, s, index):
        super().__init__(s, index)
        self.enorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hnorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.eh_proj = Linear(2 * s.hidden_size, s.hidden_size)
        self.shared_head = SharedHead(s)

    def forward(self, next_embed, main_hidden, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(next_embed), self.hnorm(main_hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin))


class Embedding(torch.nn.Module):
    def __init__(self, rows, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, dim))


class Body(torch.nn.Module):
    def __init__(self, s, rows):
        super().__init__()
        self.embed_tokens = Embedding(rows, s.hidden_size)
        self.layers = torch.nn.ModuleList(
            [DecoderLayer(s, i) for i in range(s.num_hidden_layers)]
            + [MtpLayer(s, s.num_hidden_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class DeepSeekV3(torch.nn.Module):
    """Parameter names are the checkpoint's tensor names (state_dict() keys = safetensors names).

    The embedding and head hold `rows` rows; `token_row` maps each of the vocab_size token ids to
    its row. For training, rows are the most frequent tokens of the training text plus one row
    shared by all others (`shared_count` tokens); a loaded checkpoint has one row per token."""

    def __init__(self, s, token_row, shared_count):
        super().__init__()
        self.shape = s
        rows = int(token_row.max()) + 1
        self.model = Body(s, rows)
        self.lm_head = Embedding(rows, s.hidden_size)
        self.register_buffer("token_row", token_row, persistent=False)
        self.shared_count = shared_count
        # The MTP module's own embedding and head, when a checkpoint stores different ones.
        self.mtp_embed = None
        self.mtp_head = None
        self.rope_length = 0

    @property
    def mtp(self):
        return self.model.layers[self.shape.num_hidden_layers]

    def rope(self, t):
        if t > self.rope_length:
            self.rope_length = max(t, 256)
            self.cos, self.sin = rope_tables(self.shape.qk_rope_head_dim, self.shape.rope_theta,
                                             self.rope_length)
        return self.cos[:t], self.sin[:t]

    def hidden(self, rows):
        """Main model's hidden states [B, T, H] before the final norm, for token rows [B, T]."""
        cos, sin = self.rope(rows.shape[1])
        x = F.embedding(rows, self.model.embed_tokens.weight)
        for layer in self.model.layers[:self.shape.num_hidden_layers]:
            x = layer(x, cos, sin)
        return x

    def mtp_hidden(self, next_rows, main_hidden):
        """MTP output after shared_head.norm [B, T, H]: position i is fed the row of token i+1 and
        the main hidden state i."""
        cos, sin = self.rope(next_rows.shape[1])
        embed = self.model.embed_tokens.weight if self.mtp_embed is None else self.mtp_embed
        return self.mtp(F.embedding(next_rows, embed), main_hidden, cos, sin)

    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, Moe)]


def init_weights(model, seed):
    """N(0, 0.02) for matrices (output projections of the residual branches scaled down by
    sqrt(2 x layers), as GPT-2 does), norms 1, correction biases 0."""
    gen = torch.Generator().manual_seed(seed)
    depth = model.shape.num_hidden_layers + 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(2 * depth)
                p.copy_(torch.randn(p.shape, generator=gen) * std)


# ------------------------------------------------------------------------------------------------
# the loss over the output vocabulary
# ------------------------------------------------------------------------------------------------

class _VocabLoss(torch.autograd.Function):
    """Mean cross-entropy of normalised hidden states h [N, H] through the head W [R, H] against
    target rows [N]. When `log_shared` is set, the last row stands for exp(log_shared) tokens with
    that same row: it counts that many times in the softmax's sum, once in a target's logit.

    The gradients are computed in the forward pass, a chunk of positions at a time, so the
    [N, R] logits never exist at once. Chunks hold 16 MB of logits: glibc serves blocks up to
    32 MB from its heap once they have been freed, and maps larger ones afresh each time, which
    cost a third of a step in page faults."""

    CHUNK_FLOATS = 4 << 20

    @staticmethod
    def forward(ctx, h, w, targets, log_shared):
        n = h.shape[0]
        gh = torch.empty_like(h)
        gw = torch.zeros_like(w)
        total = 0.0
        shared = w.shape[0] - 1
        wt = w.t().contiguous()
        chunk = max(1, _VocabLoss.CHUNK_FLOATS // w.shape[0])
        for begin in range(0, n, chunk):
            hc, tc = h[begin:begin + chunk], targets[begin:begin + chunk]
            logits = mm_nt(hc, w)
            if log_shared:
                logits[:, shared] += log_shared
            grad = torch.log_softmax(logits, dim=-1)
            del logits
            # A shared-row target is one of its tokens: its log-probability lacks the count.
            log_p = grad.gather(1, tc[:, None])[:, 0]
            if log_shared:
                log_p = log_p - log_shared * (tc == shared)
            total -= float(log_p.sum())
            grad.exp_()  # softmax - one-hot, the loss's gradient with respect to the logits
            grad[torch.arange(tc.shape[0]), tc] -= 1.0
            gh[begin:begin + chunk] = mm_nt(grad, wt)
            gw += mm_nt(grad.t(), hc.t())
        gh /= n
        gw /= n
        ctx.save_for_backward(gh, gw)
        return torch.tensor(total / n)

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return gh * g, gw * g, None, None


def vocab_loss(model, normed, target_rows, head):
    log_shared = math.log(model.shared_count) if model.shared_count > 0 else 0.0
    return _VocabLoss.apply(normed.reshape(-1, normed.shape[-1]), head, target_rows.reshape(-1),
                            log_shared)


# ------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------

def corpus_files(limit_bytes):
    """The running interpreter's standard library sources, sorted by path, without tests and the
    codec tables of encodings/ (pages of hex literals), up to limit_bytes of text."""
    root = sysconfig.get_path("stdlib")
    skip = {"test", "tests", "idle_test", "encodings", "site-packages", "dist-packages",
            "__pycache__"}
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if set(rel.split(os.sep)[:-1]) & skip:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if "<｜" in text or not text.strip():  # would read as a DeepSeek special token
            continue
        files.append((rel, text))
        total += len(text.encode("utf-8"))
        if total >= limit_bytes:
            break
    if not files:
        raise TrainError(f"no Python sources found under {root}")
    return root, files


def tokenize(tandem, documents):
    """Token ids of each document as BOS + text + EOS, from one `tandem tokenize` call: the
    special-token strings between documents split the text exactly where the documents meet."""
    text = "".join(BOS_TEXT + d + EOS_TEXT for d in documents)
    with tempfile.TemporaryDirectory(prefix="train-tiny-") as tmp:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        cmd = [tandem, "tokenize", "--model", TOKENIZER_DIR, "--text-file", path,
               "--no-special-tokens", "--json"]
        try:
            run = subprocess.run(cmd, capture_output=True, check=False)
        except OSError as e:
            raise TrainError(f"cannot run {tandem}: {e} (build it, or pass --tandem)") from None
        if run.returncode != 0:
            err = run.stderr.decode(errors="replace").strip()
            raise TrainError(f"{' '.join(cmd)} failed: {err}")
        ids = np.asarray(json.loads(run.stdout)["ids"], dtype=np.int64)
    bos, eos = special_ids()
    starts = np.flatnonzero(ids == bos)
    if len(starts) != len(documents) or np.count_nonzero(ids == eos) != len(documents):
        raise TrainError("the tokenizer did not split the corpus at the special tokens")
    return np.split(ids, starts[1:])


@functools.lru_cache(maxsize=None)
def special_ids():
    """BOS and EOS ids of the tokenizer (tokenizer.json's added tokens), after checking that every
    id of the tokenizer has an embedding row."""
    path = os.path.join(TOKENIZER_DIR, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        added = {t["content"]: t["id"] for t in doc["added_tokens"]}
        top = max(max(doc["model"]["vocab"].values()), max(added.values()))
        bos, eos = added[BOS_TEXT], added[EOS_TEXT]
    except (OSError, ValueError, KeyError) as e:
        raise TrainError(f"{path}: not the DeepSeek-V3 tokenizer ({e!r}); run npm ci in "
                         f"tests/oracle") from None
    if top >= VOCAB_SIZE:
        raise TrainError(f"{path}: token id {top} is beyond vocab_size {VOCAB_SIZE}")
    return bos, eos


def held_out(index):
    """Whether the file at this index of corpus_files() is held out of training (every 20th)."""
    return index % 20 == 10


class Corpus:
    """Training and held-out token streams cut into chunks of seq_len + 1 tokens, and the
    token-to-row map of the training vocabulary."""

    def __init__(self, tandem, limit_bytes, seq_len, train_vocab):
        self.root, files = corpus_files(limit_bytes)
        docs = tokenize(tandem, [text for _, text in files])
        held = [held_out(i) for i in range(len(docs))]
        train = np.concatenate([d for d, h in zip(docs, held) if not h])
        valid = np.concatenate([d for d, h in zip(docs, held) if h] or [train[:0]])
        self.files = len(files)
        self.bytes = sum(len(t.encode("utf-8")) for _, t in files)
        self.digest = hashlib.sha256(b"".join(
            r.encode() + b"\0" + t.encode() + b"\0" for r, t in files)).hexdigest()
        self.train_tokens, self.valid_tokens = len(train), len(valid)
        # Rows for the train_vocab most frequent tokens (ties to the lower id), in id order; one
        # more row is shared by every other token.
        counts = np.bincount(train, minlength=VOCAB_SIZE)
        seen = np.flatnonzero(counts)
        self.distinct = len(seen)
        if len(seen) > train_vocab - 1:
            order = np.lexsort((seen, -counts[seen]))
            seen = np.sort(seen[order[:train_vocab - 1]])
        token_row = np.full(VOCAB_SIZE, len(seen), dtype=np.int64)
        token_row[seen] = np.arange(len(seen))
        self.token_row = torch.from_numpy(token_row)
        self.shared_count = VOCAB_SIZE - len(seen)
        self.own_rows, self.coverage = len(seen), counts[seen].sum() / max(1, len(train))
        n = seq_len + 1
        self.train = torch.from_numpy(train[:len(train) // n * n].reshape(-1, n))
        self.valid = torch.from_numpy(valid[:len(valid) // n * n].reshape(-1, n))
        if len(self.train) == 0:
            raise TrainError(f"the corpus ({len(train)} tokens) is shorter than one sequence")


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------

def losses(model, chunk_rows):
    """Main and MTP cross-entropy on chunks [B, T + 1] of token rows, and the balance term."""
    inputs, targets = chunk_rows[:, :-1], chunk_rows[:, 1:]
    h = model.hidden(inputs)
    head = model.lm_head.weight
    main = vocab_loss(model, model.model.norm(h), targets, head)
    # MTP position i (0..T-2) reads h[i] and the token at i + 1, and predicts the token at i + 2.
    mtp_out = model.mtp_hidden(inputs[:, 1:], h[:, :-1])
    mtp = vocab_loss(model, mtp_out, chunk_rows[:, 2:], head)
    balance = sum(m.balance_loss for m in model.moe_layers())
    return main, mtp, balance


def update_biases(model, speed):
    """DeepSeek-V3's auxiliary-loss-free balancing: each step, raise the correction bias of experts
    that got fewer tokens than the mean and lower it for those that got more."""
    with torch.no_grad():
        for moe in model.moe_layers():
            load = moe.load
            moe.gate.e_score_correction_bias += speed * torch.sign(load.mean() - load)


@torch.no_grad()
def evaluate(model, chunks):
    """Held-out main and MTP loss, top-1 accuracies, and how often the MTP module's top-1 draft
    for position i + 2 equals the main model's top-1 at position i + 1 (the acceptance rate of
    one greedy draft token)."""
    model.eval()
    log_shared = math.log(model.shared_count) if model.shared_count > 0 else 0.0
    head = model.lm_head.weight
    shared = head.shape[0] - 1
    sums = dict(main=0.0, mtp=0.0, main_top1=0, mtp_top1=0, agree=0, n_main=0, n_mtp=0)

    def score(normed, targets):
        logits = mm_nt(normed.reshape(-1, normed.shape[-1]), head)
        tgt = logits.gather(1, targets.reshape(-1, 1))[:, 0]
        top = logits.argmax(-1).view(targets.shape)  # the shared row competes as one token
        if log_shared:
            logits[:, shared] += log_shared
        loss = torch.logsumexp(logits, dim=-1) - tgt
        return loss, top

    for begin in range(0, len(chunks), 8):
        rows = model.token_row[chunks[begin:begin + 8]]
        inputs = rows[:, :-1]
        h = model.hidden(inputs)
        loss, main_top = score(model.model.norm(h), rows[:, 1:])
        mtp_loss, mtp_top = score(model.mtp_hidden(inputs[:, 1:], h[:, :-1]), rows[:, 2:])
        sums["main"] += float(loss.sum())
        sums["mtp"] += float(mtp_loss.sum())
        sums["main_top1"] += int((main_top == rows[:, 1:]).sum())
        sums["mtp_top1"] += int((mtp_top == rows[:, 2:]).sum())
        sums["agree"] += int((mtp_top == main_top[:, 1:]).sum())
        sums["n_main"] += main_top.numel()
        sums["n_mtp"] += mtp_top.numel()
    model.train()
    return {"main_loss": sums["main"] / sums["n_main"], "mtp_loss": sums["mtp"] / sums["n_mtp"],
            "main_top1": sums["main_top1"] / sums["n_main"],
            "mtp_top1": sums["mtp_top1"] / sums["n_mtp"],
            "mtp_agreement": sums["agree"] / sums["n_mtp"], "positions": sums["n_main"]}


@torch.no_grad()
def greedy_acceptance(model, chunks, prompt_len=32, new_tokens=48):
    """Greedy decoding with one MTP draft token per step, simulated exactly: held-out prompts are
    continued greedily, and on such text the main model's choice at each position is the next
    token, so the draft made at position i (the MTP module's top-1, fed token i + 1) is accepted
    exactly when it equals token i + 2. Returns the fraction of drafts accepted."""
    model.eval()
    head = model.lm_head.weight
    seq = model.token_row[chunks[:, :prompt_len]]
    for _ in range(new_tokens):  # full recomputation: simple, and cheap at this size
        last = model.model.norm(model.hidden(seq)[:, -1])
        seq = torch.cat([seq, mm_nt(last, head).argmax(-1)[:, None]], dim=1)
    h = model.hidden(seq)
    mtp = model.mtp_hidden(seq[:, 1:], h[:, :-1])
    drafts = mm_nt(mtp.reshape(-1, mtp.shape[-1]), head).argmax(-1).view(mtp.shape[:2])
    # Drafts at positions prompt_len - 1 .. end - 3 follow a generated token and are verified.
    accepted = drafts[:, prompt_len - 1:-1] == seq[:, prompt_len + 1:]
    model.train()
    return float(accepted.float().mean())


def learning_rate(step, steps, peak, warmup):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args):
    preset = PRESETS[args.preset]
    settings = dict(preset["train"])
    for key in ("steps", "batch", "seq_len", "lr", "corpus_mb", "train_vocab"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    torch.manual_seed(args.seed)
    t0 = time.time()
    corpus = Corpus(args.tandem, int(settings["corpus_mb"] * 1e6), settings["seq_len"],
                    settings["train_vocab"])
    log(f"corpus: {corpus.files} files of {corpus.root} ({corpus.bytes / 1e6:.2f} MB), "
        f"{corpus.train_tokens} training and {corpus.valid_tokens} held-out tokens, "
        f"{corpus.distinct} distinct; the {corpus.own_rows} with rows of their own make "
        f"{100 * corpus.coverage:.2f}% of the training text; tokenized in {time.time() - t0:.1f} s")

    bos, eos = special_ids()
    config = model_config(preset["model"], bos, eos, args.dtype)
    shape = Shape(config, f"preset {args.preset}")
    model = DeepSeekV3(shape, corpus.token_row, corpus.shared_count)
    init_weights(model, args.seed)
    model.train()
    exported = export_tensors(model)
    params = sum(t.numel() for t in exported.values())
    log(f"model: {shape.num_hidden_layers} layers + MTP, hidden {shape.hidden_size}, "
        f"{shape.n_routed_experts} routed experts (top {shape.num_experts_per_tok}) + "
        f"{shape.n_shared_experts} shared; {params / 1e6:.1f}M parameters in the checkpoint, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M trained")

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=settings["lr"], betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    order, cursor = torch.randperm(len(corpus.train), generator=gen), 0
    steps, batch = settings["steps"], settings["batch"]
    history = []
    t_train = time.time()
    ema = None
    for step in range(steps):
        if cursor + batch > len(order):  # a new epoch in a new order
            order, cursor = torch.randperm(len(corpus.train), generator=gen), 0
        idx = order[cursor:cursor + batch]
        cursor += batch
        chunk_rows = corpus.token_row[corpus.train[idx]]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, settings["lr"], settings["warmup"])
        main, mtp, balance = losses(model, chunk_rows)
        loss = main + args.mtp_weight * mtp + args.balance_alpha * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_biases(model, args.bias_update_speed)
        m, t = float(main), float(mtp)
        ema = (m, t) if ema is None else (0.95 * ema[0] + 0.05 * m, 0.95 * ema[1] + 0.05 * t)
        history.append({"step": step + 1, "main_loss": round(m, 4), "mtp_loss": round(t, 4)})
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            elapsed = time.time() - t_train
            # How far the busiest expert is above the mean, worst MoE layer.
            skew = max(float(moe.load.max() / moe.load.mean()) for moe in model.moe_layers())
            log(f"step {step + 1}/{steps}: loss {m:.3f} (avg {ema[0]:.3f}), MTP {t:.3f} "
                f"(avg {ema[1]:.3f}), busiest expert {skew:.2f}x the mean, "
                f"{(step + 1) * batch * settings['seq_len'] / elapsed:.0f} tokens/s, "
                f"{elapsed:.0f} s")
    train_seconds = time.time() - t_train

    held = corpus.valid[:settings["eval_chunks"]]
    metrics = {}
    if len(held):
        metrics = evaluate(model, held)
        metrics["greedy_draft_acceptance"] = greedy_acceptance(model, held[:16])
        log(f"held-out ({metrics['positions']} positions): loss {metrics['main_loss']:.3f}, "
            f"MTP loss {metrics['mtp_loss']:.3f}, top-1 {metrics['main_top1']:.3f}, "
            f"MTP top-1 {metrics['mtp_top1']:.3f}, MTP top-1 = main's next top-1 "
            f"{metrics['mtp_agreement']:.3f}; greedy decoding accepts "
            f"{metrics['greedy_draft_acceptance']:.3f} of MTP drafts")
    write_checkpoint(args.out, model, config, args.dtype)
    training_log = {
        "preset": args.preset, "seed": args.seed, "threads": args.threads, "settings": settings,
        "mtp_weight": args.mtp_weight, "balance_alpha": args.balance_alpha,
        "bias_update_speed": args.bias_update_speed,
        "corpus": {"root": corpus.root, "files": corpus.files, "bytes": corpus.bytes,
                   "sha256": corpus.digest, "train_tokens": corpus.train_tokens,
                   "held_out_tokens": corpus.valid_tokens,
                   "distinct_training_tokens": corpus.distinct,
                   "tokens_with_own_rows": corpus.own_rows,
                   "training_text_covered_by_own_rows": round(float(corpus.coverage), 5)},
        "parameters": params,
        "tokens_trained": steps * batch * settings["seq_len"],
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t0, 1),
        "final_main_loss_avg": round(ema[0], 4) if ema else None,
        "final_mtp_loss_avg": round(ema[1], 4) if ema else None,
        "held_out": metrics, "history": history[::max(1, len(history) // 200)]}
    with open(os.path.join(args.out, "training_log.json"), "w", encoding="utf-8") as f:
        json.dump(training_log, f, indent=1)
        f.write("\n")
    log(f"wrote {args.out} ({time.time() - t0:.0f} s in all, {train_seconds:.0f} s training)")


def log(msg):
    sys.stderr.write(f"train_tiny_deepseek: {msg}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------------------------------
# checkpoint files
# ------------------------------------------------------------------------------------------------

def export_tensors(model):
    """name -> float32 tensor of the checkpoint: every token gets its own embedding and head row
    (copies of the shared row for tokens outside the training vocabulary), and the MTP layer gets
    copies of the main embedding and head, as DeepSeek-V3's release stores them."""
    s = model.shape
    mtp = f"model.layers.{s.num_hidden_layers}."
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = t[model.token_row]
        out[name] = t
    out[mtp + "embed_tokens.weight"] = (out["model.embed_tokens.weight"] if model.mtp_embed is None
                                        else model.mtp_embed[model.token_row])
    out[mtp + "shared_head.head.weight"] = (out["lm_head.weight"] if model.mtp_head is None
                                            else model.mtp_head[model.token_row])
    return out


def bf16_bits(t):
    """float32 -> bfloat16 bit patterns (round to nearest even, as torch rounds)."""
    return t.to(torch.bfloat16).view(torch.int16).numpy().astype("<u2")


def write_safetensors(path, tensors, dtype):
    """safetensors: 8-byte little-endian header length, a JSON header (dtype, shape, data_offsets
    per tensor) padded with spaces to 8 bytes, then the raw little-endian data. Weights are in
    `dtype`; the correction biases stay F32, as DeepSeek-V3 releases them. Larger elements come
    first, so every tensor is aligned to its element size."""
    items = []
    for name, t in tensors.items():
        keep_f32 = dtype == "f32" or name.endswith("e_score_correction_bias")
        data = (np.ascontiguousarray(t.numpy(), dtype="<f4") if keep_f32 else bf16_bits(t))
        items.append((0 if keep_f32 else 1, name, "F32" if keep_f32 else "BF16", list(t.shape),
                      data))
    items.sort(key=lambda item: item[0])
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _, name, st_dtype, shape, data in items:
        header[name] = {"dtype": st_dtype, "shape": shape,
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for item in items:
            f.write(item[4].tobytes())
    os.replace(tmp, path)


def write_checkpoint(out, model, config, dtype):
    os.makedirs(out, exist_ok=True)
    # Shards of an earlier checkpoint would be read instead of (or besides) model.safetensors.
    for name in os.listdir(out):
        if name == "model.safetensors.index.json" or (name.startswith("model-")
                                                      and name.endswith(".safetensors")):
            os.remove(os.path.join(out, name))
    write_safetensors(os.path.join(out, "model.safetensors"), export_tensors(model), dtype)
    write_json(os.path.join(out, "config.json"), config)
    # As tandem make-model writes it (DeepSeek-V3's generation_config.json).
    write_json(os.path.join(out, "generation_config.json"), {
        "_from_model_config": True, "bos_token_id": config["bos_token_id"], "do_sample": True,
        "eos_token_id": config["eos_token_id"], "temperature": 0.6, "top_p": 0.95,
        "transformers_version": "4.46.3"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(TOKENIZER_DIR, name), "rb") as src, \
                open(os.path.join(out, name), "wb") as dst:
            dst.write(src.read())


def write_json(path, doc):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


def read_safetensors(path):
    """name -> float32 tensor, for the F32 and BF16 files this script writes."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
    except (OSError, ValueError, struct.error) as e:
        raise TrainError(f"{path}: cannot read: {e}") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if info["dtype"] == "F32":
            values = np.frombuffer(raw, dtype="<f4")
        elif info["dtype"] == "BF16":
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise TrainError(f"{path}: tensor {name} is {info['dtype']}, expected F32 or BF16")
        out[name] = torch.from_numpy(values.copy()).view(info["shape"])
    return out


def load_model(model_dir):
    """A checkpoint folder (as `train` writes it) in this script's model, one row per token."""
    origin = os.path.join(model_dir, "config.json")
    try:
        with open(origin, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise TrainError(f"{origin}: cannot read: {e}") from None
    s = Shape(config, origin)
    model = DeepSeekV3(s, torch.arange(s.vocab_size), 0)
    tensors = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    mtp = f"model.layers.{s.num_hidden_layers}."
    model.mtp_embed = tensors.pop(mtp + "embed_tokens.weight", None)
    model.mtp_head = tensors.pop(mtp + "shared_head.head.weight", None)
    state = model.state_dict()
    missing = sorted(set(state) - set(tensors))
    extra = sorted(set(tensors) - set(state))
    if missing or extra:
        raise TrainError(f"{model_dir}: tensors missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in tensors.items():
        if list(t.shape) != list(state[name].shape):
            raise TrainError(f"{model_dir}: tensor {name} has shape {list(t.shape)}, "
                             f"expected {list(state[name].shape)}")
    model.load_state_dict(tensors)
    model.eval()
    return model


# ------------------------------------------------------------------------------------------------
# forward mode (for tests): the request format of tests/oracle/deepseek_reference.py
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def answer(model, request):
    known = {"sequences", "all_logits", "greedy_tokens", "mtp"}
    if not isinstance(request, dict) or set(request) - known:
        raise TrainError(f"request: expected an object with fields among {sorted(known)}")
    seqs = request.get("sequences")
    if not isinstance(seqs, list) or not all(isinstance(s, list) and s for s in seqs):
        raise TrainError("request: sequences must be a list of non-empty lists of token ids")
    vocab = model.shape.vocab_size
    head = model.lm_head.weight
    mtp_head = head if model.mtp_head is None else model.mtp_head

    def logits(h, weight):
        return mm_nt(h.reshape(-1, h.shape[-1]), weight)

    out = []
    for n, tokens in enumerate(seqs):
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in tokens):
            raise TrainError(f"request: sequence {n} has a token id outside [0, {vocab})")
        ids = torch.tensor([tokens])
        h = model.hidden(ids)
        rows = h if request.get("all_logits", False) else h[:, -1:]
        entry = {"logits": logits(model.model.norm(rows), head), "greedy": [],
                 "mtp_logits": torch.zeros(0, vocab)}
        seq = list(tokens)
        for _ in range(request.get("greedy_tokens", 0)):  # by full recomputation
            last = logits(model.model.norm(model.hidden(torch.tensor([seq]))[:, -1:]), head)
            seq.append(int(np.argmax(last[0].numpy())))
            entry["greedy"].append(seq[-1])
        if request.get("mtp", False) and len(tokens) > 1:
            entry["mtp_logits"] = logits(model.mtp_hidden(ids[:, 1:], h[:, :-1]), mtp_head)
        out.append(entry)
    return out


def write_answer(result, f):
    """Each float32 with 9 significant digits, which read back as the same float32."""
    fmt = "{:.9g}".format

    def matrix(t):
        return "[" + ",".join("[" + ",".join(map(fmt, row)) + "]" for row in t.tolist()) + "]"
    f.write('{"sequences":[')
    for n, e in enumerate(result):
        f.write(("," if n else "") + '{"logits":' + matrix(e["logits"]) + ',"greedy":'
                + json.dumps(e["greedy"]) + ',"mtp_logits":' + matrix(e["mtp_logits"]) + "}")
    f.write("]}\n")


def write_held_out(args):
    """The text of the held-out files, for benchmarks that need text the model has not seen."""
    limit = args.corpus_mb
    if limit is None:
        limit = PRESETS["default"]["train"]["corpus_mb"]
    _, files = corpus_files(int(limit * 1e6))
    text = "\n".join(t for i, (_, t) in enumerate(files) if held_out(i))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)


def forward(args):
    try:
        with open(args.request, encoding="utf-8") as f:
            request = json.load(f)
    except (OSError, ValueError) as e:
        raise TrainError(f"{args.request}: cannot read: {e}") from None
    result = answer(load_model(args.model), request)
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:
        write_answer(result, f)
    os.replace(args.out + ".tmp", args.out)


# ------------------------------------------------------------------------------------------------

def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train and write a checkpoint folder")
    t.add_argument("--preset", choices=sorted(PRESETS), default="default")
    t.add_argument("--out", default=DEFAULT_OUT, help=f"model folder (default {DEFAULT_OUT})")
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="weights in the checkpoint (correction biases are always F32)")
    t.add_argument("--tandem", default=os.path.join(REPO, "build", "tandem"),
                   help="the tandem binary, for its tokenizer (default: build/tandem)")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--steps", type=int, help="optimizer steps (preset's default otherwise)")
    t.add_argument("--batch", type=int, help="sequences per step")
    t.add_argument("--seq-len", type=int, help="tokens per sequence")
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--corpus-mb", type=float, help="megabytes of source text to read")
    t.add_argument("--train-vocab", type=int,
                   help="most frequent tokens with their own rows during training")
    t.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss")
    t.add_argument("--balance-alpha", type=float, default=1e-4,
                   help="weight of the sequence-wise balance loss")
    # DeepSeek-V3 used 0.001 over a run of ~10^5 steps; a few hundred steps need faster updates
    # to undo the collapse of early routing onto a few experts.
    t.add_argument("--bias-update-speed", type=float, default=0.005,
                   help="gamma of the auxiliary-loss-free bias update")
    t.add_argument("--log-every", type=int, default=50)
    f = sub.add_parser("forward", help="logits of the trainer's model for a request")
    f.add_argument("--model", required=True)
    f.add_argument("--request", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--threads", type=int, default=2)
    h = sub.add_parser("held-out", help="write the text of the files training leaves out")
    h.add_argument("--out", required=True)
    h.add_argument("--corpus-mb", type=float, help="as given to train (default preset's otherwise)")
    h.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv[1:])

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    try:
        if args.command == "train":
            train(args)
        elif args.command == "forward":
            forward(args)
        else:
            write_held_out(args)
    except TrainError as e:
        sys.stderr.write(f"train_tiny_deepseek: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
