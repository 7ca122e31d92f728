#!/usr/bin/python3
"""Self-checks of the Qwen3-MoE reference forward pass (qwen3_moe_reference.py), without the C++ engine.

Writes tiny random checkpoints in the Hugging Face layout (its own safetensors writer, F32/BF16/F16)
into temporary folders and checks: agreement with a second, plain numpy float64 implementation (per
token and per head loops, RoPE as a complex rotation, GQA by repeating the k/v projection rows,
routing by sorting) for several configurations; logits at position i equal the last logits of the
prefix 0..i; greedy tokens are the argmax of full recomputations; GQA equals multi-head attention
with repeated kv heads; mlp_only_layers and decoder_sparse_step choose dense layers, which read the
dense weights; tied embeddings; consistent renaming of experts changes nothing; rotate-half RoPE
equals the complex rotation and depends only on relative positions; the YaRN constants of the
published Qwen3 long-context setting; routing on hand-made logits; F32/BF16/F16/sharded files of the
same values give identical logits; refused configs, checkpoints and requests name the field or tensor.

Run: /usr/bin/python3 tests/oracle/test_qwen3_moe_reference.py [-v]
"""
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "qwen3_moe_reference.py")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

_spec = importlib.util.spec_from_file_location("qwen3_moe_reference", SCRIPT)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

F32 = np.float32


# ------------------------------------------------------------------------------------------------
# tiny checkpoints
# ------------------------------------------------------------------------------------------------

def tiny_config(**overrides):
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 12,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 12,  # not hidden_size / heads (8), as in Qwen3-30B-A3B (2048 / 32 = 64, head_dim 128)
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "rms_norm_eps": 1e-6, "rope_theta": 100.0, "rope_scaling": None,
        "max_position_embeddings": 128, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "attention_bias": False, "hidden_act": "silu",
        "router_aux_loss_coef": 0.001, "output_router_logits": False,
    }
    cfg.update(overrides)
    return cfg


def head_dim(cfg):
    return cfg["head_dim"] if cfg.get("head_dim") is not None else cfg["hidden_size"] // cfg["num_attention_heads"]


def is_moe(cfg, layer):
    return (layer not in (cfg.get("mlp_only_layers") or []) and cfg.get("num_experts", 0) > 0
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def generate_weights(cfg, seed=0):
    """Random float32 weights for every tensor of the HF Qwen3-MoE layout."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    w = {}

    def lin(name, out, inp, gain=1.0):
        w[name] = (rng.standard_normal((out, inp)) * gain / math.sqrt(inp)).astype(F32)

    def norm(name, n):
        w[name] = (1.0 + 0.3 * rng.standard_normal(n)).astype(F32)

    def mlp(prefix, inter):
        lin(prefix + "gate_proj.weight", inter, H)
        lin(prefix + "up_proj.weight", inter, H)
        lin(prefix + "down_proj.weight", H, inter)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, H)).astype(F32)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        norm(p + "input_layernorm.weight", H)
        norm(p + "post_attention_layernorm.weight", H)
        a = p + "self_attn."
        lin(a + "q_proj.weight", nh * d, H, gain=2.0)
        lin(a + "k_proj.weight", nkv * d, H, gain=2.0)
        lin(a + "v_proj.weight", nkv * d, H)
        lin(a + "o_proj.weight", H, nh * d)
        norm(a + "q_norm.weight", d)
        norm(a + "k_norm.weight", d)
        m = p + "mlp."
        if is_moe(cfg, layer):
            lin(m + "gate.weight", cfg["num_experts"], H, gain=3.0)
            for e in range(cfg["num_experts"]):
                mlp(f"{m}experts.{e}.", cfg["moe_intermediate_size"])
        else:
            mlp(m, cfg["intermediate_size"])
    norm("model.norm.weight", H)
    if not cfg.get("tie_word_embeddings"):
        lin("lm_head.weight", V, H)
    return w


def write_safetensors(path, tensors):
    """tensors: name -> (safetensors dtype, numpy array holding the stored representation)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, a) in tensors.items():
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def to_bf16_exact(x):
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
    bits = x.astype(F32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(F32)


def write_model(folder, cfg, weights, dtype="F32", shards=1):
    """config.json + checkpoint with every tensor stored as dtype (F32|BF16|F16; the values must be
    representable). shards > 1 writes model.safetensors.index.json and that many shard files."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    stored = {}
    for name, w in weights.items():
        if dtype == "F32":
            stored[name] = ("F32", w.astype("<f4"))
        elif dtype == "BF16":
            assert np.array_equal(to_bf16_exact(w), w), name
            stored[name] = ("BF16", (w.view(np.uint32) >> 16).astype("<u2"))
        elif dtype == "F16":
            assert np.array_equal(w.astype(np.float16).astype(F32), w), name
            stored[name] = ("F16", w.astype("<f2"))
        else:
            raise ValueError(dtype)
    if shards == 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), stored)
    else:
        names = list(stored)
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(os.path.join(folder, fname), {n: stored[n] for n in part})
            weight_map.update({n: fname for n in part})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def representable_weights(cfg, seed=0):
    """Weights exactly representable in bf16 and f16 (so F32/BF16/F16 files decode identically)."""
    out = {}
    for name, x in generate_weights(cfg, seed).items():
        y = to_bf16_exact(x)
        y[np.abs(y) < 2.0 ** -14] = 0.0  # keep clear of f16 subnormals
        out[name] = y
    return out


def run_cli(model_dir, request, tmp):
    req_path = os.path.join(tmp, "request.json")
    out_path = os.path.join(tmp, "out.json")
    with open(req_path, "w") as f:
        json.dump(request, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    proc = subprocess.run([PYTHON, SCRIPT, model_dir, req_path, out_path], capture_output=True, text=True)
    out = None
    if proc.returncode == 0:
        with open(out_path) as f:
            out = json.load(f)
    return proc, out


def arr(rows):
    return np.asarray(rows, dtype=np.float64)


SEQS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50], [1], [42, 42, 42, 7]]


# ------------------------------------------------------------------------------------------------
# a second, deliberately plain implementation: numpy float64, loops, complex RoPE, repeated kv rows
# ------------------------------------------------------------------------------------------------

class NumpyQwen3Moe:
    """Written from the formulas. GQA is done by building full multi-head k/v projections (kv head
    j's rows repeated for the heads of its group) and running plain multi-head attention per head
    and per query position; RoPE multiplies x[i] + 1j x[i + d/2] by exp(1j * angle); experts are
    chosen per token by sorting (probability descending, index ascending)."""

    def __init__(self, cfg, w):
        self.c = cfg
        self.w = {k: v.astype(np.float64) for k, v in w.items()}
        d = head_dim(cfg)
        theta = cfg["rope_theta"]
        freqs = np.array([theta ** (-(2.0 * i) / d) for i in range(d // 2)])
        self.amp = 1.0
        rs = cfg.get("rope_scaling")
        if rs:
            factor = rs["factor"]
            orig = rs["original_max_position_embeddings"]
            # the pair index at which a wavelength 2 pi / f fits `turns` times into orig positions
            lo = math.floor(d * math.log(orig / (2 * math.pi * rs.get("beta_fast", 32))) / (2 * math.log(theta)))
            hi = math.ceil(d * math.log(orig / (2 * math.pi * rs.get("beta_slow", 1))) / (2 * math.log(theta)))
            lo, hi = max(lo, 0), min(hi, d - 1)
            if lo == hi:
                hi = hi + 0.001
            blended = []
            for i, f in enumerate(freqs):
                t = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep f, 1: f / factor
                blended.append(f * (1 - t) + (f / factor) * t)
            freqs = np.array(blended)
            self.amp = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        self.freqs = freqs

    def rope(self, v, position):
        """v [heads, d] at one position."""
        d = v.shape[-1]
        z = (v[..., :d // 2] + 1j * v[..., d // 2:]) * np.exp(1j * position * self.freqs) * self.amp
        return np.concatenate([z.real, z.imag], axis=-1)

    @staticmethod
    def rms(x, w, eps):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def mlp(self, p, x):
        g = x @ self.w[p + "gate_proj.weight"].T
        return ((g / (1 + np.exp(-g))) * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T

    def moe(self, p, x):
        c = self.c
        E, k = c["num_experts"], c["num_experts_per_tok"]
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            logits = self.w[p + "gate.weight"] @ x[t]
            probs = np.exp(logits - logits.max())
            probs = probs / probs.sum()
            chosen = sorted(range(E), key=lambda e: (-probs[e], e))[:k]
            weights = np.array([probs[e] for e in chosen])
            if c["norm_topk_prob"]:
                weights = weights / weights.sum()
            for e, wt in zip(chosen, weights):
                out[t] += wt * self.mlp(f"{p}experts.{e}.", x[t])
        return out

    def attention(self, a, h):
        c, w = self.c, self.w
        nh, nkv, d, eps = c["num_attention_heads"], c["num_key_value_heads"], head_dim(c), c["rms_norm_eps"]
        group = nh // nkv
        # multi-head projections: head i uses kv head i // group
        wk = np.concatenate([w[a + "k_proj.weight"][(i // group) * d:(i // group + 1) * d] for i in range(nh)])
        wv = np.concatenate([w[a + "v_proj.weight"][(i // group) * d:(i // group + 1) * d] for i in range(nh)])
        T = h.shape[0]
        q = [self.rope(self.rms((h[t] @ w[a + "q_proj.weight"].T).reshape(nh, d), w[a + "q_norm.weight"], eps), t)
             for t in range(T)]
        k = [self.rope(self.rms((h[t] @ wk.T).reshape(nh, d), w[a + "k_norm.weight"], eps), t) for t in range(T)]
        v = [(h[t] @ wv.T).reshape(nh, d) for t in range(T)]
        out = np.zeros((T, nh, d))
        for head in range(nh):
            for t in range(T):
                sc = np.array([q[t][head] @ k[u][head] / math.sqrt(d) for u in range(t + 1)])
                pr = np.exp(sc - sc.max())
                pr = pr / pr.sum()
                out[t, head] = sum(pr[u] * v[u][head] for u in range(t + 1))
        return out.reshape(T, nh * d) @ w[a + "o_proj.weight"].T

    def forward(self, tokens):
        c, w = self.c, self.w
        eps = c["rms_norm_eps"]
        x = w["model.embed_tokens.weight"][tokens]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + self.attention(p + "self_attn.", self.rms(x, w[p + "input_layernorm.weight"], eps))
            h = self.rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + (self.moe(p + "mlp.", h) if is_moe(c, i) else self.mlp(p + "mlp.", h))
        head = w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else w["lm_head.weight"]
        return self.rms(x, w["model.norm.weight"], eps) @ head.T


class TmpDirCase(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def model(self, name, cfg, weights=None, **kw):
        folder = os.path.join(self.tmp, name)
        write_model(folder, cfg, weights if weights is not None else generate_weights(cfg), **kw)
        return folder

    def logits(self, folder, seqs=SEQS):
        return ref.run_request(ref.Model(folder), {"sequences": seqs, "all_logits": True})

    def assertClose(self, a, b, tol, msg=""):
        a, b = arr(a), arr(b)
        self.assertEqual(a.shape, b.shape, msg)
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = max(1.0, float(np.max(np.abs(b))) if b.size else 1.0)
        self.assertLessEqual(err, tol * scale, f"{msg}: max abs diff {err} (scale {scale})")

    def assertDiffer(self, a, b, tol, msg=""):
        """The change under test moves the logits by more than tol * scale (the check has teeth)."""
        a, b = arr(a), arr(b)
        scale = max(1.0, float(np.max(np.abs(b))))
        self.assertGreater(float(np.max(np.abs(a - b))), tol * scale, msg)


# ------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------

class BuildingBlocks(unittest.TestCase):
    def _rope(self, **over):
        class Cfg:
            path = "config.json"
            head_dim = 16
            rope_theta = 100.0
            rope_scaling = None
        for k, v in over.items():
            setattr(Cfg, k, v)
        return ref.Rope(Cfg)

    def test_rms_norm_formula(self):
        x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
        w = torch.tensor([1.0, 0.5, 2.0, -1.0])
        expected = x.numpy()[0] / math.sqrt((1 + 4 + 9 + 0.25) / 4 + 1e-3) * w.numpy()
        np.testing.assert_allclose(ref.rms_norm(x, w, 1e-3).numpy()[0], expected, rtol=1e-6)

    def test_yarn_is_transformers_yarn(self):
        # transformers' _compute_yarn_parameters (v5) for head_dim 128, rope_theta 1e6 and
        # max_position_embeddings 40960: pairs 20, 26, 30, 33, 36, 40 and the magnitude.
        cases = [
            ({"rope_type": "yarn", "factor": 4.0}, 1.138629436111989,
             [0.01333521432163324, 0.00332952880732352, 0.0011322989162202146,
              0.00048587543673854055, 0.00019844541337815636, 5.2302335589380085e-05]),
            ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
              "attention_factor": 1.25}, 1.25,
             [0.01333521432163324, 0.003168422574711092, 0.0010643609812470017,
              0.00045032357551376927, 0.00017984115587395423, 4.445698525097307e-05]),
            ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768,
              "mscale": 0.8, "mscale_all_dim": 0.5}, 1.0565079928608092,
             [0.01333521432163324, 0.003087869458404878, 0.0009851000571115868,
              0.00039107047347248386, 0.0001395319312815162, 2.2228492625486534e-05]),
            ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768,
              "mscale_all_dim": 1.0}, 1.2079441541679836,
             [0.01333521432163324, 0.003087869458404878, 0.0009851000571115868,
              0.00039107047347248386, 0.0001395319312815162, 2.2228492625486534e-05]),
            ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
              "beta_fast": 16, "beta_slow": 2, "truncate": False}, 1.138629436111989,
             [0.01333521432163324, 0.003651741272548377, 0.001157093516936135,
              0.0004172829799528355, 0.00011986686741615794, 4.445698525097307e-05]),
        ]
        for scaling, magnitude, freqs in cases:
            rope = self._rope(head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                              rope_scaling=scaling)
            self.assertAlmostEqual(rope.scale, magnitude, places=14, msg=scaling)
            np.testing.assert_allclose(rope.inv_freq[[20, 26, 30, 33, 36, 40]], freqs, rtol=1e-12,
                                       err_msg=str(scaling))

    def test_rope_rotates_half_pairs_like_a_complex_rotation(self):
        rope = self._rope()
        rng = np.random.default_rng(1)
        x = rng.standard_normal((5, 3, 16)).astype(F32)  # [positions, heads, d]
        positions = [0, 1, 7, 30, 101]
        cos, sin = rope.cos_sin(positions)
        got = ref.Rope.apply(torch.from_numpy(x), cos.unsqueeze(1), sin.unsqueeze(1)).numpy()
        freqs = 100.0 ** (-np.arange(8) * 2.0 / 16)
        z = (x[..., :8] + 1j * x[..., 8:]) * np.exp(1j * np.array(positions)[:, None, None] * freqs)
        np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), atol=2e-5)
        self.assertTrue(np.array_equal(got[0], x[0]))  # position 0 is the identity

    def test_rope_scores_depend_on_relative_position(self):
        rope = self._rope(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        rng = np.random.default_rng(2)
        q, k = torch.from_numpy(rng.standard_normal(16).astype(F32)), torch.from_numpy(rng.standard_normal(16).astype(F32))

        def score(pq, pk):
            cq, sq = rope.cos_sin([pq])
            ck, sk = rope.cos_sin([pk])
            return float(ref.Rope.apply(q, cq[0], sq[0]) @ ref.Rope.apply(k, ck[0], sk[0]))
        self.assertAlmostEqual(score(5, 2), score(40, 37), places=4)
        self.assertAlmostEqual(score(9, 9), score(0, 0), places=4)
        self.assertNotAlmostEqual(score(5, 2), score(5, 3), places=3)

    def test_yarn_constants_of_the_published_long_context_setting(self):
        # Qwen3 model cards: rope_scaling {"rope_type": "yarn", "factor": 4.0,
        # "original_max_position_embeddings": 32768}; head_dim 128, rope_theta 1e6
        rope = self._rope(head_dim=128, rope_theta=1e6, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
        self.assertEqual(rope.correction_range, (23, 40))
        self.assertAlmostEqual(rope.scale, 1.0 + 0.1 * math.log(4.0), places=12)
        self.assertAlmostEqual(rope.scale, 1.138629436, places=8)
        plain = 1e6 ** (-np.arange(0, 128, 2) / 128.0)
        np.testing.assert_allclose(rope.inv_freq[:24], plain[:24], rtol=1e-12)     # pairs 0..23 kept
        np.testing.assert_allclose(rope.inv_freq[40:], plain[40:] / 4, rtol=1e-12)  # 40..63 interpolated
        mid = (30 - 23) / (40 - 23)
        self.assertAlmostEqual(rope.inv_freq[30], plain[30] * (1 - mid) + plain[30] / 4 * mid, places=15)
        cos, sin = rope.cos_sin([0])
        self.assertAlmostEqual(float(cos[0, 0]), 1.138629436, places=6)  # cos and sin carry the factor
        # "type" is accepted as the older spelling of "rope_type"; defaults beta_fast 32, beta_slow 1
        old = self._rope(head_dim=128, rope_theta=1e6, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32, "beta_slow": 1})
        self.assertTrue(np.array_equal(old.inv_freq, rope.inv_freq))

    def _router(self, k, norm, experts=6):
        class Cfg:
            num_experts = experts
            num_experts_per_tok = k
            norm_topk_prob = norm
        return ref.Router.__new__(ref.Router), Cfg

    def route(self, logits, k, norm):
        router, cfg = self._router(k, norm, experts=len(logits[0]))
        router.cfg = cfg
        return router.route(torch.tensor(logits, dtype=torch.float32))

    def test_router_softmax_topk_and_renormalisation(self):
        logits = [[0.0, 2.0, 1.0, 3.0, -1.0, 2.5]]
        p = np.exp(np.array(logits[0]) - 3.0)
        p = p / p.sum()
        idx, wts = self.route(logits, 3, False)
        self.assertEqual(idx.tolist(), [[3, 5, 1]])
        np.testing.assert_allclose(wts.numpy()[0], p[[3, 5, 1]], rtol=1e-6)  # softmax over all experts
        idx, wts = self.route(logits, 3, True)
        self.assertEqual(idx.tolist(), [[3, 5, 1]])
        np.testing.assert_allclose(wts.numpy()[0], p[[3, 5, 1]] / p[[3, 5, 1]].sum(), rtol=1e-6)
        idx, wts = self.route(logits, 1, True)
        self.assertEqual(idx.tolist(), [[3]])
        self.assertAlmostEqual(float(wts[0, 0]), 1.0, places=6)

    def test_router_ties_go_to_the_lower_index(self):
        idx, wts = self.route([[1.0, 2.0, 0.0, 2.0, 2.0, 1.0]], 2, True)
        self.assertEqual(idx.tolist(), [[1, 3]])
        np.testing.assert_allclose(wts.numpy()[0], [0.5, 0.5], rtol=1e-6)
        idx, _ = self.route([[1.0, 0.0, 1.0, 0.0, 1.0, 1.0]], 3, False)
        self.assertEqual(idx.tolist(), [[0, 2, 4]])


# ------------------------------------------------------------------------------------------------
# whole-model properties
# ------------------------------------------------------------------------------------------------

NUMPY_CASES = {
    "gqa, mlp_only_layers [1]": {},
    "multi-head (kv_heads = heads), head_dim default": dict(num_key_value_heads=4, head_dim=None),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "beta_fast": 8, "beta_slow": 0.5}),
    "sparse step 2, tied, no renormalisation, mqa": dict(decoder_sparse_step=2, mlp_only_layers=[],
                                                         tie_word_embeddings=True, norm_topk_prob=False,
                                                         num_key_value_heads=1),
    "top-1, large rms_norm_eps": dict(num_experts_per_tok=1, num_experts=5, mlp_only_layers=[0, 3], rms_norm_eps=0.05),
}


class ModelProperties(TmpDirCase):
    def test_matches_plain_numpy_implementation(self):
        for n, (name, over) in enumerate(NUMPY_CASES.items()):
            with self.subTest(name):
                cfg = tiny_config(**over)
                if cfg.get("head_dim") is None:
                    del cfg["head_dim"]
                w = generate_weights(cfg, seed=n)
                model = ref.Model(self.model(f"m{n}", cfg, w))
                if "head_dim" not in cfg:
                    self.assertEqual(model.cfg.head_dim, 8)
                got = ref.run_request(model, {"sequences": SEQS, "all_logits": True})
                plain = NumpyQwen3Moe(cfg, w)
                for s, o in zip(SEQS, got["sequences"]):
                    self.assertClose(o["logits"], plain.forward(s), 2e-5, name)

    def test_yarn_changes_the_logits(self):
        cfg = tiny_config(**NUMPY_CASES["yarn"])
        w = generate_weights(cfg)
        yarn = self.logits(self.model("yarn", cfg, w))
        plain = self.logits(self.model("plain", tiny_config(), w))
        self.assertDiffer(yarn["sequences"][0]["logits"], plain["sequences"][0]["logits"], 1e-3)

    def test_prefix_logits_greedy_and_cli(self):
        folder = self.model("m", tiny_config())
        proc, full = run_cli(folder, {"sequences": SEQS, "all_logits": True, "greedy_tokens": 4}, self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual((proc.stdout, proc.stderr), ("", ""))
        self.assertEqual(set(full), {"sequences"})
        prefixes = [s[:i + 1] for s in SEQS for i in range(len(s))]
        proc, last = run_cli(folder, {"sequences": prefixes}, self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        model = ref.Model(folder)
        k = 0
        for n, s in enumerate(SEQS):
            out = full["sequences"][n]
            self.assertEqual(set(out), {"logits", "greedy", "greedy_margins"})
            self.assertEqual(np.shape(out["logits"]), (len(s), 97))
            for i in range(len(s)):
                self.assertEqual(np.shape(last["sequences"][k]["logits"]), (1, 97))
                self.assertEqual(last["sequences"][k]["greedy"], [])
                self.assertClose(last["sequences"][k]["logits"][0], out["logits"][i], 1e-5, f"seq {n} pos {i}")
                k += 1
            # greedy continuation = argmax of the full recomputation at each step
            greedy = out["greedy"]
            self.assertEqual(len(greedy), 4)
            self.assertEqual(greedy[0], int(np.argmax(out["logits"][-1])))
            ext = model.logits(model.hidden(s + greedy[:-1]))
            self.assertEqual(greedy[1:], [int(np.argmax(ext[len(s) - 1 + j].numpy())) for j in range(1, 4)])
            margins = out["greedy_margins"]
            self.assertEqual(len(margins), 4)
            first = np.sort(np.array(out["logits"][-1], dtype=np.float64))
            self.assertAlmostEqual(margins[0], (first[-1] - first[-2]) / np.max(np.abs(first)), places=6)
            self.assertTrue(all(m >= 0 for m in margins))
        # the file's 9-digit numbers parse back to exactly the float32 logits computed in process
        row = np.array(full["sequences"][0]["logits"], dtype=np.float64).astype(F32)
        self.assertTrue(np.array_equal(row, model.logits(model.hidden(SEQS[0])).numpy()))
        # without all_logits: only the last row, equal to the last row of all_logits
        proc, only_last = run_cli(folder, {"sequences": SEQS}, self.tmp)
        for o, f in zip(only_last["sequences"], full["sequences"]):
            self.assertEqual(o["logits"], f["logits"][-1:])
            self.assertEqual((o["greedy"], o["greedy_margins"]), ([], []))

    def test_gqa_equals_multi_head_with_repeated_kv_heads(self):
        cfg = tiny_config(num_key_value_heads=2)
        w = generate_weights(cfg)
        d, group = head_dim(cfg), 2
        mha_cfg = tiny_config(num_key_value_heads=4)
        m = dict(w)
        for layer in range(cfg["num_hidden_layers"]):
            a = f"model.layers.{layer}.self_attn."
            for proj in ("k_proj.weight", "v_proj.weight"):
                m[a + proj] = np.concatenate([w[a + proj][(h // group) * d:(h // group + 1) * d] for h in range(4)])
        gqa = self.logits(self.model("gqa", cfg, w))
        mha = self.logits(self.model("mha", mha_cfg, m))
        for g, h in zip(gqa["sequences"], mha["sequences"]):
            self.assertClose(g["logits"], h["logits"], 1e-5, "gqa vs repeated mha")
        # the other grouping (head h reading kv head h % kv_heads) gives other logits
        other = dict(w)
        for layer in range(cfg["num_hidden_layers"]):
            a = f"model.layers.{layer}.self_attn."
            for proj in ("k_proj.weight", "v_proj.weight"):
                other[a + proj] = np.concatenate([w[a + proj][(h % 2) * d:(h % 2 + 1) * d] for h in range(4)])
        wrong = self.logits(self.model("interleaved", mha_cfg, other))
        self.assertDiffer(wrong["sequences"][0]["logits"], gqa["sequences"][0]["logits"], 1e-3)

    def test_mlp_only_layers_and_sparse_step_choose_dense_layers(self):
        def kinds(**over):
            model = ref.Model(self.model("k" + str(len(os.listdir(self.tmp))), tiny_config(**over)))
            return [type(layer.mlp).__name__ for layer in model.layers]
        self.assertEqual(kinds(), ["Moe", "Mlp", "Moe", "Moe"])
        self.assertEqual(kinds(mlp_only_layers=[], decoder_sparse_step=2), ["Mlp", "Moe", "Mlp", "Moe"])
        self.assertEqual(kinds(mlp_only_layers=[3], decoder_sparse_step=2), ["Mlp", "Moe", "Mlp", "Mlp"])
        self.assertEqual(kinds(mlp_only_layers=[], decoder_sparse_step=3), ["Mlp", "Mlp", "Moe", "Mlp"])
        self.assertEqual(kinds(num_experts=0), ["Mlp", "Mlp", "Mlp", "Mlp"])

    def test_mlp_only_layer_reads_the_dense_weights(self):
        cfg = tiny_config(mlp_only_layers=[1])
        w = generate_weights(cfg)
        self.assertIn("model.layers.1.mlp.down_proj.weight", w)
        self.assertNotIn("model.layers.1.mlp.gate.weight", w)
        base = self.logits(self.model("base", cfg, w))
        changed = dict(w, **{"model.layers.1.mlp.down_proj.weight": 2 * w["model.layers.1.mlp.down_proj.weight"]})
        other = self.logits(self.model("changed", cfg, changed))
        self.assertDiffer(other["sequences"][0]["logits"], base["sequences"][0]["logits"], 1e-3)
        # zeroing the dense MLP of layer 1 = a layer without a feed-forward contribution
        zero = dict(w, **{"model.layers.1.mlp.down_proj.weight": np.zeros_like(w["model.layers.1.mlp.down_proj.weight"])})
        out = self.logits(self.model("zero", cfg, zero))
        plain = NumpyQwen3Moe(cfg, zero)
        self.assertClose(out["sequences"][0]["logits"], plain.forward(SEQS[0]), 2e-5)
        # the same weights with layer 1 as a MoE layer: its router and experts are missing
        with self.assertRaisesRegex(ref.OracleError, r"model\.layers\.1\.mlp\.gate\.weight is missing"):
            ref.Model(self.model("moe1", tiny_config(mlp_only_layers=[]), w))
        # expert tensors stored for the dense layer are not silently ignored
        extra = dict(w, **{"model.layers.1.mlp.experts.0.up_proj.weight": np.zeros((12, 32), F32)})
        with self.assertRaisesRegex(ref.OracleError, r"model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight"):
            ref.Model(self.model("extra", cfg, extra))

    def test_tied_embeddings(self):
        cfg = tiny_config(tie_word_embeddings=True)
        w = generate_weights(cfg)
        self.assertNotIn("lm_head.weight", w)
        tied = self.logits(self.model("tied", cfg, w))
        u = dict(w, **{"lm_head.weight": w["model.embed_tokens.weight"]})
        untied = self.logits(self.model("untied", tiny_config(), u))
        self.assertEqual(tied, untied)
        # a stored lm_head is ignored when tied ...
        rng = np.random.default_rng(9)
        other_head = (rng.standard_normal((97, 32)) / 6).astype(F32)
        stored = self.logits(self.model("stored", cfg, dict(w, **{"lm_head.weight": other_head})))
        self.assertEqual(stored, tied)
        # ... and used when not (the check has teeth)
        used = self.logits(self.model("used", tiny_config(), dict(w, **{"lm_head.weight": other_head})))
        self.assertDiffer(used["sequences"][0]["logits"], tied["sequences"][0]["logits"], 1e-3)
        # untied without lm_head.weight is an error naming it
        with self.assertRaisesRegex(ref.OracleError, r"lm_head\.weight is missing"):
            ref.Model(self.model("nohead", tiny_config(), w))

    def test_expert_renaming_changes_nothing(self):
        cfg = tiny_config()
        w = generate_weights(cfg)
        perm = np.random.default_rng(5).permutation(cfg["num_experts"])  # new e <- old perm[e]
        self.assertFalse(np.array_equal(perm, np.arange(len(perm))))
        v = dict(w)
        for layer in range(cfg["num_hidden_layers"]):
            if not is_moe(cfg, layer):
                continue
            m = f"model.layers.{layer}.mlp."
            v[m + "gate.weight"] = w[m + "gate.weight"][perm]
            for new, old in enumerate(perm):
                for p in ("gate_proj", "up_proj", "down_proj"):
                    v[f"{m}experts.{new}.{p}.weight"] = w[f"{m}experts.{old}.{p}.weight"]
        a = self.logits(self.model("a", cfg, w))
        b = self.logits(self.model("b", cfg, v))
        for s, t in zip(a["sequences"], b["sequences"]):
            self.assertClose(t["logits"], s["logits"], 1e-5, "renamed experts")
        # renaming only the router rows (not the experts) does change the logits
        c = dict(w)
        for layer in range(cfg["num_hidden_layers"]):
            if is_moe(cfg, layer):
                c[f"model.layers.{layer}.mlp.gate.weight"] = w[f"model.layers.{layer}.mlp.gate.weight"][perm]
        d = self.logits(self.model("c", cfg, c))
        self.assertDiffer(d["sequences"][0]["logits"], a["sequences"][0]["logits"], 1e-3)

    def test_norm_topk_prob_changes_the_logits(self):
        w = generate_weights(tiny_config())
        a = self.logits(self.model("norm", tiny_config(norm_topk_prob=True), w))
        b = self.logits(self.model("raw", tiny_config(norm_topk_prob=False), w))
        self.assertDiffer(a["sequences"][0]["logits"], b["sequences"][0]["logits"], 1e-3)

    def test_storage_formats_decode_identically(self):
        cfg = tiny_config()
        w = representable_weights(cfg)
        req = {"sequences": SEQS, "all_logits": True, "greedy_tokens": 2}
        results = [ref.run_request(ref.Model(self.model(d, cfg, w, dtype=d)), req) for d in ("F32", "BF16", "F16")]
        self.assertEqual(results[1], results[0])
        self.assertEqual(results[2], results[0])
        sharded = ref.run_request(ref.Model(self.model("sharded", cfg, w, dtype="BF16", shards=3)), req)
        self.assertEqual(sharded, results[0])
        self.assertEqual(len([f for f in os.listdir(os.path.join(self.tmp, "sharded")) if f.endswith(".safetensors")]), 3)


# ------------------------------------------------------------------------------------------------
# refusals and errors
# ------------------------------------------------------------------------------------------------

class Errors(TmpDirCase):
    def _expect_error(self, folder, request, *needles):
        proc, _ = run_cli(folder, request, self.tmp)
        self.assertEqual(proc.returncode, 1, proc.stderr)
        self.assertEqual(proc.stdout, "")
        self.assertEqual(proc.stderr.count("\n"), 1, proc.stderr)
        self.assertTrue(proc.stderr.startswith("qwen3_moe_reference: error: "), proc.stderr)
        for needle in needles:
            self.assertIn(needle, proc.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "out.json")))

    def _config_error(self, name, cfg, *needles, weights=None):
        w = weights if weights is not None else generate_weights(tiny_config())
        self._expect_error(self.model(name, cfg, w), {"sequences": [[1]]}, "config.json", *needles)

    def test_refused_config_values(self):
        self._config_error("sliding", tiny_config(use_sliding_window=True, sliding_window=4), "use_sliding_window")
        self._config_error("bias", tiny_config(attention_bias=True), "attention_bias")
        self._config_error("act", tiny_config(hidden_act="gelu"), "hidden_act")
        self._config_error("arch", tiny_config(architectures=["Qwen3ForCausalLM"]), "architectures")
        self._config_error("arch2", tiny_config(architectures=["Qwen3MoeForCausalLM", "X"]), "architectures")
        self._config_error("rope", tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling")
        self._config_error("rope2", tiny_config(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling")
        # Without original_max_position_embeddings YaRN takes max_position_embeddings, and an
        # attention_factor is the magnitude (test_yarn_is_transformers_yarn); a wrong type is refused.
        self._config_error("yarn", tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "truncate": "no"}),
                           "rope_scaling.truncate")
        self._config_error("yarn2", tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 16,
                                                              "attention_factor": "1.0"}),
                           "rope_scaling.attention_factor")
        self._config_error("quant", tiny_config(quantization_config={"quant_method": "fp8"}), "quantization_config")
        self._config_error("gqa", tiny_config(num_key_value_heads=3), "num_key_value_heads")
        self._config_error("topk", tiny_config(num_experts_per_tok=9), "num_experts_per_tok")
        self._config_error("mlp_only", tiny_config(mlp_only_layers=[4]), "mlp_only_layers")
        self._config_error("step", tiny_config(decoder_sparse_step=0), "decoder_sparse_step")
        self._config_error("tie", tiny_config(tie_word_embeddings="yes"), "tie_word_embeddings")

    def test_missing_config_fields(self):
        for field in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "rms_norm_eps", "rope_theta", "num_experts", "num_experts_per_tok",
                      "moe_intermediate_size", "norm_topk_prob", "intermediate_size"):
            with self.subTest(field):
                cfg = tiny_config()
                del cfg[field]
                self._config_error("no_" + field, cfg, field, "missing")
        # intermediate_size is only needed when a layer is dense
        cfg = tiny_config(mlp_only_layers=[])
        del cfg["intermediate_size"]
        folder = self.model("all_moe", cfg)
        proc, _ = run_cli(folder, {"sequences": [[1]]}, self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        # optional fields have their documented defaults
        cfg = tiny_config(mlp_only_layers=[])
        for field in ("decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings", "use_sliding_window",
                      "attention_bias", "hidden_act", "rope_scaling", "head_dim"):
            del cfg[field]
        folder = self.model("defaults", cfg, generate_weights(tiny_config(mlp_only_layers=[], head_dim=None)))
        model = ref.Model(folder)
        self.assertEqual((model.cfg.head_dim, model.cfg.decoder_sparse_step, model.cfg.tie_word_embeddings),
                         (8, 1, False))

    def test_checkpoint_errors_name_the_tensor(self):
        cfg = tiny_config()
        w = generate_weights(cfg)
        req = {"sequences": [[1]]}
        missing = dict(w)
        del missing["model.layers.2.mlp.experts.5.up_proj.weight"]
        self._expect_error(self.model("missing", cfg, missing), req, "model.layers.2.mlp.experts.5.up_proj.weight", "missing")
        no_qnorm = dict(w)
        del no_qnorm["model.layers.0.self_attn.q_norm.weight"]
        self._expect_error(self.model("noqnorm", cfg, no_qnorm), req, "model.layers.0.self_attn.q_norm.weight")
        bad = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((48, 32), dtype=F32)})
        self._expect_error(self.model("shape", cfg, bad), req, "model.layers.0.self_attn.k_proj.weight", "shape")
        extra = dict(w, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(48, dtype=F32)})
        self._expect_error(self.model("extra", cfg, extra), req, "q_proj.bias")
        shared = dict(w, **{"model.layers.0.mlp.shared_expert.up_proj.weight": np.zeros((12, 32), dtype=F32)})
        self._expect_error(self.model("shared", cfg, shared), req, "shared_expert")
        nan = dict(w)
        nan["model.norm.weight"] = nan["model.norm.weight"].copy()
        nan["model.norm.weight"][3] = np.nan
        self._expect_error(self.model("nan", cfg, nan), req, "model.norm.weight", "NaN")
        # an unsupported dtype is named
        folder = os.path.join(self.tmp, "i8")
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
        stored = {n: ("F32", a) for n, a in w.items()}
        stored["model.norm.weight"] = ("I8", np.ones(32, dtype=np.int8))
        write_safetensors(os.path.join(folder, "model.safetensors"), stored)
        self._expect_error(folder, req, "model.norm.weight", "I8")
        # no checkpoint file; a shard index pointing at a missing file
        os.remove(os.path.join(self.tmp, "extra", "model.safetensors"))
        self._expect_error(os.path.join(self.tmp, "extra"), req, "model.safetensors")
        sharded = self.model("sharded", cfg, w, shards=2)
        os.remove(os.path.join(sharded, "model-00002-of-00002.safetensors"))
        self._expect_error(sharded, req, "model-00002-of-00002.safetensors")

    def test_request_errors(self):
        folder = self.model("m", tiny_config())
        self._expect_error(folder, {"sequences": [[1, 97]]}, "97", "vocab_size")
        self._expect_error(folder, {"sequences": [[1]], "mtp": True}, "unknown field", "mtp")
        self._expect_error(folder, {"sequences": [[1]], "attention": "naive"}, "unknown field", "attention")
        self._expect_error(folder, {"sequences": [[]]}, "sequences")
        self._expect_error(folder, {"sequences": [[1]], "greedy_tokens": -1}, "greedy_tokens")
        self._expect_error(folder, {"sequences": [[1]], "all_logits": 1}, "all_logits")
        self._expect_error(os.path.join(self.tmp, "nowhere"), {"sequences": [[1]]}, "nowhere")


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
