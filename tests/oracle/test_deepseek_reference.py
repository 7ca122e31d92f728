#!/usr/bin/python3
"""Self-checks of the DeepSeek reference forward pass (deepseek_reference.py), without the C++ engine.

Writes tiny random checkpoints in the Hugging Face layout (its own safetensors writer, its own FP8/INT8
encoders) into temporary folders and checks properties that must hold whatever the weights are:
absorbed MLA equals naive MLA; incremental decoding through the latent cache equals the full forward;
logits at position i equal the last logits of the prefix 0..i; consistent renaming of experts changes
nothing; group-limited routing with one group equals plain top-k; routing follows the published rules
on hand-made scores; interleaved RoPE equals DeepSeek's complex rotation and HF's permuted rotate_half
form; YaRN constants match the published V3/V2-Lite values; F32/BF16/F16/FP8/INT8 and sharded
checkpoints of the same weights give identical logits; MTP consumes the embedding of token i+1 (first)
and the main model's pre-norm hidden state i; errors name the tensor or field.

Run: /usr/bin/python3 tests/oracle/test_deepseek_reference.py [-v]
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
SCRIPT = os.path.join(HERE, "deepseek_reference.py")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

_spec = importlib.util.spec_from_file_location("deepseek_reference", SCRIPT)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

F32 = np.float32


# ------------------------------------------------------------------------------------------------
# tiny checkpoints
# ------------------------------------------------------------------------------------------------

def tiny_config(**overrides):
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3,
        "n_group": 4, "topk_group": 2, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "rope_theta": 100.0,
        # low = 0, high = 3 for this dim/theta: the ramp has fractional entries
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
        "max_position_embeddings": 256, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    cfg.update(overrides)
    return cfg


def is_moe(cfg, layer):
    return (cfg.get("n_routed_experts") is not None and layer >= cfg.get("first_k_dense_replace", 0)
            and layer % cfg.get("moe_layer_freq", 1) == 0)


def generate_weights(cfg, seed=0):
    """Random float32 weights for every tensor of the HF layout (names from kernels-engine.md 3.6)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, dn, dr, dv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                      cfg["v_head_dim"])
    r, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    w = {}

    def lin(name, out, inp, gain=1.0):
        w[name] = (rng.standard_normal((out, inp)) * gain / math.sqrt(inp)).astype(F32)

    def norm(name, n):
        w[name] = (1.0 + 0.2 * rng.standard_normal(n)).astype(F32)

    def mlp(prefix, inter):
        lin(prefix + "gate_proj.weight", inter, H)
        lin(prefix + "up_proj.weight", inter, H)
        lin(prefix + "down_proj.weight", H, inter)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, H)).astype(F32)
    L = cfg["num_hidden_layers"]
    for layer in range(L + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{layer}."
        norm(p + "input_layernorm.weight", H)
        norm(p + "post_attention_layernorm.weight", H)
        a = p + "self_attn."
        if qr is None:
            lin(a + "q_proj.weight", nh * (dn + dr), H)
        else:
            lin(a + "q_a_proj.weight", qr, H)
            norm(a + "q_a_layernorm.weight", qr)
            lin(a + "q_b_proj.weight", nh * (dn + dr), qr)
        lin(a + "kv_a_proj_with_mqa.weight", r + dr, H)
        norm(a + "kv_a_layernorm.weight", r)
        lin(a + "kv_b_proj.weight", nh * (dn + dv), r)
        lin(a + "o_proj.weight", H, nh * dv)
        m = p + "mlp."
        if is_moe(cfg, layer):
            E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            lin(m + "gate.weight", E, H, gain=2.0)
            if cfg.get("topk_method") == "noaux_tc":
                w[m + "gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(F32)
            for e in range(E):
                mlp(f"{m}experts.{e}.", inter)
            if cfg.get("n_shared_experts"):
                mlp(m + "shared_experts.", inter * cfg["n_shared_experts"])
        else:
            mlp(m, cfg["intermediate_size"])
        if layer >= L:
            w[p + "embed_tokens.weight"] = rng.standard_normal((V, H)).astype(F32)
            norm(p + "enorm.weight", H)
            norm(p + "hnorm.weight", H)
            lin(p + "eh_proj.weight", H, 2 * H)
            norm(p + "shared_head.norm.weight", H)
            lin(p + "shared_head.head.weight", V, H)
    norm("model.norm.weight", H)
    if not cfg.get("tie_word_embeddings"):
        lin("lm_head.weight", V, H)
    return w


def write_safetensors(path, tensors):
    """tensors: name -> (safetensors dtype, numpy array holding the stored representation)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
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


def fp8_value(code):
    """float8 e4m3fn decoding, written independently of the reference (integer * 2^k form)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    return sign * (math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10))


FP8_CODES = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
FP8_VALUES = np.array([fp8_value(int(c)) for c in FP8_CODES], dtype=F32)


FP8_BY_CODE = np.zeros(256, dtype=F32)
FP8_BY_CODE[FP8_CODES] = FP8_VALUES


def quantize_fp8(w, block, scale_dtype="F32"):
    """Block-scaled FP8: returns (codes uint8, scale_inv float32, dequantised float32). With
    scale_dtype BF16 the scales are rounded to bf16 (and the dequantised values use the rounded ones)."""
    rows, cols = w.shape
    br, bc = block
    nbr, nbc = -(-rows // br), -(-cols // bc)
    scale = np.zeros((nbr, nbc), dtype=F32)
    codes = np.zeros(w.shape, dtype=np.uint8)
    for i in range(nbr):
        for j in range(nbc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = F32(np.abs(blk).max() / 448.0) or F32(1.0)
            if scale_dtype == "BF16":
                s = to_bf16_exact(np.array([s], dtype=F32))[0]
            scale[i, j] = s
            idx = np.abs(FP8_VALUES[None, :] - (blk / s).reshape(-1, 1)).argmin(axis=1)
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = FP8_CODES[idx].reshape(blk.shape)
    deq = np.zeros(w.shape, dtype=F32)
    for i in range(rows):
        for j in range(cols):
            deq[i, j] = FP8_BY_CODE[codes[i, j]] * scale[i // br, j // bc]
    return codes, scale, deq


def quantize_i8(w):
    scale = (np.abs(w).max(axis=1, keepdims=True) / 127.0).astype(F32)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return codes, scale, (codes.astype(F32) * scale).astype(F32)


def quantizable(name):
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def write_model(folder, cfg, weights, dtype="F32", quant=None, block=(128, 128), shards=1, scale_dtype="F32"):
    """Write config.json + checkpoint. dtype: storage of unquantised tensors (F32|BF16|F16; the
    values must be representable). quant: None|"fp8"|"i8" for every projection weight. Returns the
    float32 weights the checkpoint decodes to."""
    os.makedirs(folder, exist_ok=True)
    cfg = dict(cfg)
    if quant == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    stored, decoded = {}, {}
    for name, w in weights.items():
        if quant and quantizable(name):
            base = name[: -len(".weight")]
            if quant == "fp8":
                codes, scale, deq = quantize_fp8(w, block, scale_dtype)
                stored[name] = ("F8_E4M3", codes)
                stored[base + ".weight_scale_inv"] = (
                    ("BF16", (scale.view(np.uint32) >> 16).astype("<u2")) if scale_dtype == "BF16"
                    else ("F32", scale))
            else:
                codes, scale, deq = quantize_i8(w)
                stored[name] = ("I8", codes)
                stored[base + ".weight_scale"] = ("F32", scale)
            decoded[name] = deq
        elif dtype == "F32":
            stored[name] = ("F32", w.astype("<f4"))
            decoded[name] = w
        elif dtype == "BF16":
            assert np.array_equal(to_bf16_exact(w), w), name
            stored[name] = ("BF16", (w.view(np.uint32) >> 16).astype("<u2"))
            decoded[name] = w
        elif dtype == "F16":
            assert np.array_equal(w.astype(np.float16).astype(F32), w), name
            stored[name] = ("F16", w.astype("<f2"))
            decoded[name] = w
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
    return decoded


def representable_weights(cfg, seed=0):
    """Weights exactly representable in bf16 and f16 (so F32/BF16/F16 files decode identically)."""
    w = generate_weights(cfg, seed)
    out = {}
    for name, x in w.items():
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


SEQS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71], [1], [42, 42, 42, 7]]

# ------------------------------------------------------------------------------------------------
# a second, deliberately plain implementation: numpy float64, loops, HF's rotate_half RoPE layout
# ------------------------------------------------------------------------------------------------

def _mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


class NumpyDeepseek:
    """Written from the formulas (HF modeling_deepseek conventions: RoPE on the half layout after
    permuting the interleaved pairs; per-token routing by sorting; per-head, per-position attention)."""

    def __init__(self, cfg, w):
        self.c, self.w = cfg, {k: v.astype(np.float64) for k, v in w.items()}
        c = cfg
        dim = c["qk_rope_head_dim"]
        inv = 1.0 / c["rope_theta"] ** (np.arange(0, dim, 2) / dim)
        self.cos_sin_mult, self.score_mult = 1.0, 1.0
        rs = c.get("rope_scaling")
        if rs:
            f = rs["factor"]
            orig = rs.get("original_max_position_embeddings", 4096)

            def cdim(rot):
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(c["rope_theta"]))
            lo = max(math.floor(cdim(rs.get("beta_fast", 32))), 0)
            hi = min(math.ceil(cdim(rs.get("beta_slow", 1))), dim - 1)
            hi = hi + 0.001 if lo == hi else hi
            extra_mask = 1.0 - np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0, 1)
            inv = (inv / f) * (1 - extra_mask) + inv * extra_mask
            self.cos_sin_mult = _mscale(f, rs.get("mscale", 1)) / _mscale(f, rs.get("mscale_all_dim", 0))
            if rs.get("mscale_all_dim"):
                self.score_mult = _mscale(f, rs["mscale_all_dim"]) ** 2
        self.inv = inv

    def rope(self, v, positions):
        """v [T, (heads,) dim], interleaved pairs -> HF: permute to halves, then v*cos + rotate_half(v)*sin."""
        dim = v.shape[-1]
        v = np.concatenate([v[..., 0::2], v[..., 1::2]], axis=-1)
        ang = np.outer(positions, self.inv)
        emb = np.concatenate([ang, ang], axis=-1)
        shape = (len(positions),) + (1,) * (v.ndim - 2) + (dim,)
        cos = (np.cos(emb) * self.cos_sin_mult).reshape(shape)
        sin = (np.sin(emb) * self.cos_sin_mult).reshape(shape)
        rot = np.concatenate([-v[..., dim // 2:], v[..., :dim // 2]], axis=-1)
        return v * cos + rot * sin

    @staticmethod
    def rms(x, w, eps):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def mlp(self, p, x):
        g = x @ self.w[p + "gate_proj.weight"].T
        return ((g / (1 + np.exp(-g))) * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T

    def moe(self, p, x):
        c = self.c
        E, k = c["n_routed_experts"], c["num_experts_per_tok"]
        method = {"gready": "greedy"}.get(c.get("topk_method"), c.get("topk_method"))
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            logits = self.w[p + "gate.weight"] @ x[t]
            if c["scoring_func"] == "softmax":
                s = np.exp(logits - logits.max())
                s = s / s.sum()
            else:
                s = 1 / (1 + np.exp(-logits))
            ch = s + self.w[p + "gate.e_score_correction_bias"] if method == "noaux_tc" else s
            candidates = list(range(E))
            n_group = c.get("n_group") or 1
            if method != "greedy" and n_group > 1:
                gs = E // n_group
                gscore = []
                for g in range(n_group):
                    members = sorted(ch[g * gs:(g + 1) * gs], reverse=True)
                    gscore.append(members[0] + members[1] if method == "noaux_tc" else members[0])
                kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:c["topk_group"]]
                candidates = [e for e in range(E) if e // gs in kept]
            chosen = sorted(candidates, key=lambda e: (-ch[e], e))[:k]
            wts = np.array([s[e] for e in chosen])
            if c.get("norm_topk_prob") and k > 1:
                wts = wts / wts.sum()
            wts = wts * c.get("routed_scaling_factor", 1.0)
            for e, wt in zip(chosen, wts):
                out[t] += wt * self.mlp(f"{p}experts.{e}.", x[t:t + 1])[0]
        if c.get("n_shared_experts"):
            out += self.mlp(p + "shared_experts.", x)
        return out

    def layer(self, i, x, positions):
        c, w = self.c, self.w
        p = f"model.layers.{i}."
        a = p + "self_attn."
        eps = c["rms_norm_eps"]
        nh, dn, dr, dv, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                             c["v_head_dim"], c["kv_lora_rank"])
        T = x.shape[0]
        h = self.rms(x, w[p + "input_layernorm.weight"], eps)
        if c["q_lora_rank"] is None:
            q = h @ w[a + "q_proj.weight"].T
        else:
            q = self.rms(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6) @ w[a + "q_b_proj.weight"].T
        q = q.reshape(T, nh, dn + dr)
        q_nope, q_pe = q[..., :dn], self.rope(q[..., dn:], positions)
        kv = h @ w[a + "kv_a_proj_with_mqa.weight"].T
        lat = self.rms(kv[:, :r], w[a + "kv_a_layernorm.weight"], 1e-6)
        k_pe = self.rope(kv[:, r:], positions)
        kvb = (lat @ w[a + "kv_b_proj.weight"].T).reshape(T, nh, dn + dv)
        scale = (dn + dr) ** -0.5 * self.score_mult
        out = np.zeros((T, nh, dv))
        for head in range(nh):
            for t in range(T):
                sc = np.array([(q_nope[t, head] @ kvb[u, head, :dn] + q_pe[t, head] @ k_pe[u]) * scale
                               for u in range(t + 1)])
                pr = np.exp(sc - sc.max())
                pr = pr / pr.sum()
                out[t, head] = sum(pr[u] * kvb[u, head, dn:] for u in range(t + 1))
        x = x + out.reshape(T, nh * dv) @ w[a + "o_proj.weight"].T
        h = self.rms(x, w[p + "post_attention_layernorm.weight"], eps)
        return x + (self.moe(p + "mlp.", h) if is_moe(c, i) else self.mlp(p + "mlp.", h))

    def forward(self, tokens, mask_position0=False):
        """(logits [T, V], MTP logits [T-1, V] or None), optionally with vLLM's position-0 embedding mask."""
        c, w = self.c, self.w
        L, eps = c["num_hidden_layers"], c["rms_norm_eps"]
        x = w["model.embed_tokens.weight"][tokens]
        positions = np.arange(len(tokens))
        for i in range(L):
            x = self.layer(i, x, positions)
        head = w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else w["lm_head.weight"]
        logits = self.rms(x, w["model.norm.weight"], eps) @ head.T
        mtp = None
        if c.get("num_nextn_predict_layers") and len(tokens) > 1:
            p = f"model.layers.{L}."
            n = len(tokens) - 1
            e = w[p + "embed_tokens.weight"][tokens[1:]].copy()
            if mask_position0:
                e[0] = 0.0
            y = np.concatenate([self.rms(e, w[p + "enorm.weight"], eps), self.rms(x[:n], w[p + "hnorm.weight"], eps)],
                               axis=1) @ w[p + "eh_proj.weight"].T
            y = self.layer(L, y, positions[:n])
            mtp = self.rms(y, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T
        return logits, mtp



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

    def assertClose(self, a, b, tol, msg=""):
        a, b = arr(a), arr(b)
        self.assertEqual(a.shape, b.shape, msg)
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = max(1.0, float(np.max(np.abs(b))) if b.size else 1.0)
        self.assertLessEqual(err, tol * scale, f"{msg}: max abs diff {err} (scale {scale})")


# ------------------------------------------------------------------------------------------------
# building blocks against published formulas
# ------------------------------------------------------------------------------------------------

class BuildingBlocks(unittest.TestCase):
    def test_fp8_table(self):
        t = ref.FP8_E4M3_TABLE
        self.assertEqual(t[0x00], 0.0)
        self.assertEqual(t[0x38], 1.0)
        self.assertEqual(t[0x7E], 448.0)        # largest finite e4m3fn
        self.assertEqual(t[0x08], 2.0 ** -6)    # smallest normal
        self.assertEqual(t[0x01], 2.0 ** -9)    # smallest subnormal
        self.assertEqual(t[0x07], 7 * 2.0 ** -9)
        self.assertEqual(t[0xC0], -2.0)
        self.assertEqual(t[0x3C], 1.5)
        self.assertTrue(np.isnan(t[0x7F]) and np.isnan(t[0xFF]))
        for code in range(256):
            if code not in (0x7F, 0xFF):
                self.assertEqual(t[code], F32(fp8_value(code)), hex(code))
        pos = t[:0x7F]
        self.assertTrue(np.all(np.diff(pos) > 0))  # codes 0..0x7E increase strictly

    def test_rope_equals_complex_rotation_and_hf_permuted_form(self):
        cfg = ref.Config.__new__(ref.Config)
        cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.path = 8, 100.0, None, "cfg"
        rope = ref.Rope(cfg)
        rng = np.random.default_rng(1)
        positions = [0, 1, 5, 17, 63]
        x = torch.tensor(rng.standard_normal((len(positions), 8)), dtype=torch.float32)
        y = torch.tensor(rng.standard_normal((len(positions), 8)), dtype=torch.float32)
        cos, sin = rope.cos_sin(positions)
        ours_x, ours_y = ref.Rope.apply(x, cos, sin), ref.Rope.apply(y, cos, sin)
        # DeepSeek model.py: view (x[2i], x[2i+1]) as complex, multiply by e^{i pos inv_freq}
        angles = torch.tensor(np.outer(positions, rope.inv_freq), dtype=torch.float32)
        freqs = torch.polar(torch.ones_like(angles), angles)
        official = torch.view_as_real(torch.view_as_complex(x.reshape(len(positions), 4, 2)) * freqs).flatten(-2)
        self.assertTrue(torch.allclose(ours_x, official, atol=2e-5))
        # HF modeling_deepseek: permute interleaved -> half layout, then rotate_half with cat(freqs, freqs)

        def hf(v):
            v = v.view(len(positions), 4, 2).transpose(2, 1).reshape(len(positions), 8)
            c, s = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
            rot = torch.cat([-v[:, 4:], v[:, :4]], -1)
            return v * c + rot * s
        self.assertTrue(torch.allclose((ours_x * ours_y).sum(-1), (hf(x) * hf(y)).sum(-1), atol=1e-5))
        # the HF output is a permutation of DeepSeek's: same values, half layout
        perm = list(range(0, 8, 2)) + list(range(1, 8, 2))
        self.assertTrue(torch.allclose(ours_x[:, perm], hf(x), atol=2e-5))

    def test_rope_scores_depend_on_relative_position(self):
        cfg = ref.Config.__new__(ref.Config)
        cfg.qk_rope_head_dim, cfg.rope_theta, cfg.path = 8, 100.0, "cfg"
        cfg.rope_scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        rope = ref.Rope(cfg)
        rng = np.random.default_rng(2)
        q = torch.tensor(rng.standard_normal(8), dtype=torch.float32)
        k = torch.tensor(rng.standard_normal(8), dtype=torch.float32)

        def score(pq, pk):
            cq, sq = rope.cos_sin([pq])
            ck, sk = rope.cos_sin([pk])
            return float((ref.Rope.apply(q, cq[0], sq[0]) * ref.Rope.apply(k, ck[0], sk[0])).sum())
        for pq, pk in [(5, 2), (9, 9), (40, 3)]:
            self.assertAlmostEqual(score(pq, pk), score(pq + 50, pk + 50), places=4)

    def test_yarn_constants_of_published_configs(self):
        # DeepSeek-V3: dim 64, theta 1e4, factor 40, original 4096, beta 32/1, mscale 1/1
        cfg = ref.Config.__new__(ref.Config)
        cfg.qk_rope_head_dim, cfg.rope_theta, cfg.path = 64, 10000.0, "cfg"
        cfg.rope_scaling = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        rope = ref.Rope(cfg)
        base = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
        # correction range low = 10, high = 23 (kernels-engine.md 3.4)
        np.testing.assert_allclose(rope.inv_freq[:11], base[:11], rtol=1e-12)
        np.testing.assert_allclose(rope.inv_freq[23:], base[23:] / 40, rtol=1e-12)
        i = 16
        ramp = (i - 10) / 13
        self.assertAlmostEqual(rope.inv_freq[i], base[i] * (1 - ramp) + base[i] / 40 * ramp, places=15)
        self.assertAlmostEqual(rope.softmax_scale_factor, 1.874, places=3)  # x1.874 (V3)
        self.assertEqual(rope.cos_sin_scale, 1.0)
        # DeepSeek-V2-Lite: mscale 0.707 / 0.707 -> x1.590
        cfg.rope_scaling = dict(cfg.rope_scaling, mscale=0.707, mscale_all_dim=0.707)
        rope = ref.Rope(cfg)
        self.assertAlmostEqual(rope.softmax_scale_factor, 1.590, places=3)
        self.assertEqual(rope.cos_sin_scale, 1.0)
        # mscale != mscale_all_dim: cos/sin carry the ratio (HF _mscale); no mscale_all_dim: no softmax factor
        cfg.rope_scaling = {"type": "yarn", "factor": 40, "mscale": 1.0}
        rope = ref.Rope(cfg)
        self.assertAlmostEqual(rope.cos_sin_scale, 1 + 0.1 * math.log(40), places=12)
        self.assertEqual(rope.softmax_scale_factor, 1.0)

    def _router(self, **over):
        raw = tiny_config(hidden_size=8, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                          routed_scaling_factor=2.0)
        raw.update(over)
        cfg = ref.Config.__new__(ref.Config)
        cfg.__dict__.update(raw)
        cfg.arch = "v3"
        router = ref.Router.__new__(ref.Router)
        router.cfg = cfg
        router.weight = torch.eye(8)
        router.bias = None
        return router

    @staticmethod
    def _logits_for(probs):
        p = np.asarray(probs, dtype=np.float64)
        return torch.tensor(np.log(p / (1 - p))[None, :], dtype=torch.float32)  # sigmoid^-1

    def test_router_noaux_tc_groups_by_top2_sum(self):
        router = self._router(topk_method="noaux_tc")
        router.bias = torch.zeros(8)
        # groups (2 experts each): sums of top-2 = 0.91, 1.2, 1.0, 0.2 -> groups 1 and 2 survive,
        # so expert 0 (the single best score) is excluded
        x = self._logits_for([0.9, 0.01, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1])
        idx, w = router(x)
        self.assertEqual(idx.tolist(), [[2, 3]])  # tie 0.6/0.6 -> lower index first
        self.assertTrue(torch.allclose(w, torch.tensor([[1.0, 1.0]])))  # normalised 0.5/0.5, x2.0
        # the bias steers the choice, the weights come from the unbiased scores
        router.bias = torch.tensor([0, 0, 0, 0, 0, 0.45, 0, 0], dtype=torch.float32)
        idx, w = router(x)
        self.assertEqual(idx.tolist(), [[5, 2]])  # group 2 sum 1.45 is now best; 0.95 > 0.6
        self.assertTrue(torch.allclose(w, torch.tensor([[0.5, 0.6]]) / 1.1 * 2.0, atol=1e-6))

    def test_router_excluded_groups_lose_to_negative_scores(self):
        # selection scores below zero in the kept groups still beat every expert of an excluded group
        # (model.py / vLLM mask with -inf; masking with 0.0 would pick expert 0 or 1 here)
        router = self._router(topk_method="noaux_tc")
        router.bias = torch.full((8,), -0.9)
        router.bias[0] = router.bias[1] = -0.95
        x = self._logits_for([0.3, 0.3, 0.6, 0.5, 0.55, 0.52, 0.1, 0.1])
        idx, _ = router(x)
        self.assertEqual(idx.tolist(), [[2, 4]])

    def test_router_group_limited_greedy_by_max(self):
        router = self._router(topk_method="group_limited_greedy", scoring_func="sigmoid")
        x = self._logits_for([0.9, 0.01, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1])
        idx, _ = router(x)
        self.assertEqual(idx.tolist(), [[0, 2]])  # group maxima 0.9, 0.6, 0.5, 0.1 -> groups 0, 1

    def test_router_softmax_without_normalisation(self):
        router = self._router(topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
                              routed_scaling_factor=1.5)
        x = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, 0.5, 2.5, 0.0]])
        idx, w = router(x)
        p = torch.softmax(x, -1)[0]
        self.assertEqual(idx.tolist(), [[3, 6]])
        self.assertTrue(torch.allclose(w, torch.stack([p[3], p[6]])[None] * 1.5))

    def test_router_top1_is_not_renormalised(self):
        router = self._router(topk_method="greedy", num_experts_per_tok=1)
        x = self._logits_for([0.1, 0.2, 0.3, 0.7, 0.1, 0.1, 0.1, 0.1])
        idx, w = router(x)
        self.assertEqual(idx.tolist(), [[3]])
        self.assertAlmostEqual(float(w), 0.7 * 2.0, places=5)


# ------------------------------------------------------------------------------------------------
# whole-model properties
# ------------------------------------------------------------------------------------------------

class ModelProperties(TmpDirCase):
    def test_absorbed_equals_naive(self):
        for q_lora in (24, None):
            folder = self.model(f"m{q_lora}", tiny_config(q_lora_rank=q_lora))
            model = ref.Model(folder)
            # layer level, random inputs at scattered positions
            rng = np.random.default_rng(3)
            x = torch.tensor(rng.standard_normal((6, 32)), dtype=torch.float32)
            attn = model.layers[1].attn
            a, _ = attn(x, [0, 1, 2, 3, 4, 5], None, "naive")
            b, _ = attn(x, [0, 1, 2, 3, 4, 5], None, "absorbed")
            self.assertLessEqual(float((a - b).abs().max()), 1e-5 * max(1.0, float(a.abs().max())))
            # end to end, including MTP
            req = {"sequences": SEQS, "all_logits": True, "mtp": True}
            naive = ref.run_request(model, req)
            absorbed = ref.run_request(model, dict(req, attention="absorbed"))
            for s, t in zip(naive["sequences"], absorbed["sequences"]):
                self.assertClose(t["logits"], s["logits"], 1e-5, "logits")
                self.assertClose(t["mtp_logits"], s["mtp_logits"], 1e-5, "mtp logits")

    def test_matches_plain_numpy_implementation(self):
        configs = {
            "v3": tiny_config(),
            "v2_no_qlora_softmax_groups": tiny_config(
                q_lora_rank=None, scoring_func="softmax", topk_method="group_limited_greedy", norm_topk_prob=False,
                routed_scaling_factor=1.7, n_shared_experts=2, tie_word_embeddings=True,
                rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "mscale": 0.707, "mscale_all_dim": 0.707}),
            "no_yarn_top1": tiny_config(rope_scaling=None, num_experts_per_tok=1, topk_group=1, rope_theta=10000.0),
        }
        for name, cfg in configs.items():
            w = generate_weights(cfg, seed=11)
            mask = name == "v3"
            out = ref.run_request(ref.Model(self.model(name, cfg, w)),
                                  {"sequences": SEQS, "all_logits": True, "mtp": True, "mtp_mask_position0": mask})
            plain = NumpyDeepseek(cfg, w)
            for s, o in zip(SEQS, out["sequences"]):
                logits, mtp = plain.forward(s, mask)
                self.assertClose(o["logits"], logits, 2e-5, f"{name} logits")
                if mtp is None:
                    self.assertEqual(o["mtp_logits"], [])
                else:
                    self.assertClose(o["mtp_logits"], mtp, 2e-5, f"{name} mtp")

    def test_incremental_cache_equals_full_forward(self):
        model = ref.Model(self.model("m", tiny_config()))
        tokens = SEQS[0]
        for mode in ("naive", "absorbed"):
            full = model.logits(model.hidden(tokens, mode=mode))
            for chunks in ([1] * len(tokens), [4, 1, 1, 3, 1], [7, 3]):
                cache = ref.Cache(len(model.layers))
                rows, start = [], 0
                for n in chunks:
                    rows.append(model.logits(model.hidden(tokens[start:start + n], cache, mode)))
                    start += n
                self.assertEqual(cache.length, len(tokens))
                self.assertClose(torch.cat(rows), full, 1e-5, f"{mode} {chunks}")

    def test_prefix_logits_greedy_and_cli(self):
        folder = self.model("m", tiny_config())
        proc, full = run_cli(folder, {"sequences": SEQS, "all_logits": True, "greedy_tokens": 4}, self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout, "")
        self.assertEqual(proc.stderr, "")
        prefixes = [s[:i + 1] for s in SEQS for i in range(len(s))]
        proc, last = run_cli(folder, {"sequences": prefixes}, self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        k = 0
        for n, s in enumerate(SEQS):
            out = full["sequences"][n]
            self.assertEqual(len(out["logits"]), len(s))
            self.assertEqual(out["mtp_logits"], [])
            for i in range(len(s)):
                self.assertEqual(len(last["sequences"][k]["logits"]), 1)
                self.assertClose(last["sequences"][k]["logits"][0], out["logits"][i], 1e-5, f"seq {n} pos {i}")
                k += 1
            # greedy continuation = argmax of the full recomputation at each step
            greedy = out["greedy"]
            self.assertEqual(len(greedy), 4)
            self.assertEqual(greedy[0], int(np.argmax(out["logits"][-1])))
            model = ref.Model(folder)
            ext = model.logits(model.hidden(s + greedy[:-1]))
            self.assertEqual(greedy[1:], [int(np.argmax(ext[len(s) - 1 + j].numpy())) for j in range(1, 4)])
            # each margin: the gap between the two largest logits of its row, over the largest |logit|
            margins = out["greedy_margins"]
            self.assertEqual(len(margins), 4)
            first = np.sort(np.array(out["logits"][-1], dtype=np.float64))
            self.assertAlmostEqual(margins[0], (first[-1] - first[-2]) / np.max(np.abs(first)), places=6)
            self.assertTrue(all(m >= 0 for m in margins))

    def test_expert_renaming_changes_nothing(self):
        cfg = tiny_config()
        w = generate_weights(cfg)
        # permute experts inside each group and permute the groups: routing sees the same candidates
        rng = np.random.default_rng(5)
        gs = cfg["n_routed_experts"] // cfg["n_group"]
        group_perm = rng.permutation(cfg["n_group"])
        perm = np.concatenate([g * gs + rng.permutation(gs) for g in group_perm])  # new e <- old perm[e]
        self.assertFalse(np.array_equal(perm, np.arange(len(perm))))
        v = dict(w)
        for layer in range(cfg["num_hidden_layers"] + 1):
            m = f"model.layers.{layer}.mlp."
            if not is_moe(cfg, layer):
                continue
            v[m + "gate.weight"] = w[m + "gate.weight"][perm]
            v[m + "gate.e_score_correction_bias"] = w[m + "gate.e_score_correction_bias"][perm]
            for new, old in enumerate(perm):
                for p in ("gate_proj", "up_proj", "down_proj"):
                    v[f"{m}experts.{new}.{p}.weight"] = w[f"{m}experts.{old}.{p}.weight"]
        req = {"sequences": SEQS, "all_logits": True, "mtp": True}
        a = ref.run_request(ref.Model(self.model("a", cfg, w)), req)
        b = ref.run_request(ref.Model(self.model("b", cfg, v)), req)
        for s, t in zip(a["sequences"], b["sequences"]):
            self.assertClose(t["logits"], s["logits"], 1e-5, "logits")
            self.assertClose(t["mtp_logits"], s["mtp_logits"], 1e-5, "mtp logits")

    def test_single_group_equals_plain_topk(self):
        req = {"sequences": SEQS, "all_logits": True}
        base = tiny_config(topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1)
        w = generate_weights(base)
        plain = ref.run_request(ref.Model(self.model("plain", base, w)), req)
        grouped = tiny_config(topk_method="group_limited_greedy", scoring_func="softmax", n_group=1, topk_group=1)
        got = ref.run_request(ref.Model(self.model("grouped", grouped, w)), req)
        self.assertEqual(got, plain)
        # noaux_tc keeping every group equals noaux_tc with one group
        cfg1 = tiny_config(n_group=1, topk_group=1)
        w1 = generate_weights(cfg1)
        one = ref.run_request(ref.Model(self.model("one", cfg1, w1)), req)
        cfg4 = tiny_config(n_group=4, topk_group=4)
        four = ref.run_request(ref.Model(self.model("four", cfg4, w1)), req)
        self.assertEqual(four, one)
        # and limiting groups does change something for these weights (the test has teeth)
        cfg2 = tiny_config(n_group=4, topk_group=2)
        two = ref.run_request(ref.Model(self.model("limited", cfg2, w1)), req)
        self.assertNotEqual(two, one)

    def test_storage_formats_decode_identically(self):
        cfg = tiny_config()
        w = representable_weights(cfg)
        req = {"sequences": SEQS, "all_logits": True, "mtp": True}
        results = [ref.run_request(ref.Model(self.model(d, cfg, w, dtype=d)), req) for d in ("F32", "BF16", "F16")]
        self.assertEqual(results[1], results[0])
        self.assertEqual(results[2], results[0])
        sharded = ref.run_request(ref.Model(self.model("sharded", cfg, w, shards=3)), req)
        self.assertEqual(sharded, results[0])

    def test_quantised_weights_decode_to_their_dequantised_values(self):
        cfg = tiny_config()
        w = generate_weights(cfg)
        req = {"sequences": SEQS, "all_logits": True, "mtp": True}
        cases = (("fp8", (128, 128), "F32"), ("fp8", (16, 8), "F32"), ("fp8", (16, 8), "BF16"),
                 ("i8", (128, 128), "F32"))
        for n, (quant, block, scale_dtype) in enumerate(cases):
            folder = os.path.join(self.tmp, f"q{n}")
            decoded = write_model(folder, cfg, w, quant=quant, block=block, scale_dtype=scale_dtype)
            q = ref.run_request(ref.Model(folder), req)
            plain = ref.run_request(ref.Model(self.model(f"plain{n}", cfg, decoded)), req)
            self.assertEqual(q, plain, f"{quant} {block} {scale_dtype}")
            # and the quantisation was real: the decoded weights differ from the originals
            self.assertFalse(np.array_equal(decoded["model.layers.0.self_attn.o_proj.weight"],
                                            w["model.layers.0.self_attn.o_proj.weight"]))

    def test_dense_model_v2_layout(self):
        cfg = tiny_config(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                          n_routed_experts=None, num_nextn_predict_layers=0, rope_scaling=None)
        for key in ("n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "topk_method",
                    "scoring_func", "moe_layer_freq", "first_k_dense_replace"):
            cfg.pop(key)
        model = ref.Model(self.model("dense", cfg))
        self.assertTrue(all(isinstance(layer.mlp, ref.Mlp) for layer in model.layers))
        out = ref.run_request(model, {"sequences": SEQS, "greedy_tokens": 2})
        self.assertEqual([len(s["greedy"]) for s in out["sequences"]], [2, 2, 2])
        with self.assertRaisesRegex(ref.OracleError, "num_nextn_predict_layers"):
            ref.run_request(model, {"sequences": SEQS, "mtp": True})

    def test_moe_layer_freq_and_v2_softmax_routing(self):
        cfg = tiny_config(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                          num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=2, topk_method="gready",
                          scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
                          routed_scaling_factor=1.0, n_shared_experts=2, num_nextn_predict_layers=0)
        model = ref.Model(self.model("freq", cfg))
        kinds = [type(layer.mlp).__name__ for layer in model.layers]
        self.assertEqual(kinds, ["Mlp", "Mlp", "Moe", "Mlp"])
        self.assertEqual(model.cfg.topk_method, "greedy")
        ref.run_request(model, {"sequences": SEQS})

    def test_tied_embeddings(self):
        cfg = tiny_config(tie_word_embeddings=True)
        w = generate_weights(cfg)
        tied = ref.run_request(ref.Model(self.model("tied", cfg, w)), {"sequences": SEQS, "all_logits": True})
        untied_cfg = tiny_config(tie_word_embeddings=False)
        u = dict(w, **{"lm_head.weight": w["model.embed_tokens.weight"]})
        untied = ref.run_request(ref.Model(self.model("untied", untied_cfg, u)), {"sequences": SEQS, "all_logits": True})
        self.assertEqual(tied, untied)


class Mtp(TmpDirCase):
    def _mtp_weights(self, cfg, hidden_path):
        """MTP layer whose decoder layer adds nothing (o_proj and every down_proj zero). With
        hidden_path, eh_proj = [0 | I] passes hnorm(h_i); otherwise [I | 0] passes enorm(e_{i+1})."""
        w = generate_weights(cfg)
        H = cfg["hidden_size"]
        p = f"model.layers.{cfg['num_hidden_layers']}."
        for name in list(w):
            if name.startswith(p) and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
                w[name] = np.zeros_like(w[name])
        eye, zero = np.eye(H, dtype=F32), np.zeros((H, H), dtype=F32)
        w[p + "eh_proj.weight"] = np.concatenate([zero, eye] if hidden_path else [eye, zero], axis=1)
        return w, p

    def test_mtp_reads_pre_norm_hidden_state_i(self):
        cfg = tiny_config()
        w, p = self._mtp_weights(cfg, hidden_path=True)
        w[p + "hnorm.weight"] = np.ones(cfg["hidden_size"], dtype=F32)
        w[p + "shared_head.norm.weight"] = w["model.norm.weight"]
        w[p + "shared_head.head.weight"] = w["lm_head.weight"]
        out = ref.run_request(ref.Model(self.model("m", cfg, w)), {"sequences": SEQS, "all_logits": True, "mtp": True})
        for s, o in zip(SEQS, out["sequences"]):
            self.assertEqual(len(o["mtp_logits"]), len(s) - 1)
            # rmsnorm(w * rmsnorm(h)) with unit hnorm = rmsnorm(h) up to eps: MTP logits i = main logits i
            self.assertClose(o["mtp_logits"], o["logits"][:len(s) - 1], 1e-4, "mtp vs main")

    def test_mtp_embeds_next_token_first_and_masks_position0(self):
        cfg = tiny_config()
        w, p = self._mtp_weights(cfg, hidden_path=False)
        model = ref.Model(self.model("m", cfg, w))
        eps = cfg["rms_norm_eps"]

        def expected(token):
            e = w[p + "embed_tokens.weight"][token].astype(np.float64)
            e = e / np.sqrt(np.mean(e * e) + eps) * w[p + "enorm.weight"]
            x = e / np.sqrt(np.mean(e * e) + eps) * w[p + "shared_head.norm.weight"]
            return w[p + "shared_head.head.weight"].astype(np.float64) @ x
        for mask in (True, False):
            out = ref.run_request(model, {"sequences": SEQS, "mtp": True, "mtp_mask_position0": mask})
            for s, o in zip(SEQS, out["sequences"]):
                rows = [expected(s[i + 1]) for i in range(len(s) - 1)]
                if mask and rows:
                    rows[0] = np.zeros(cfg["vocab_size"])
                if not rows:
                    self.assertEqual(o["mtp_logits"], [])
                    continue
                self.assertClose(o["mtp_logits"], np.array(rows), 1e-5, f"mask {mask}")

    def test_mtp_is_causal_and_shaped(self):
        model = ref.Model(self.model("m", tiny_config()))
        s = SEQS[0]
        full = ref.run_request(model, {"sequences": [s], "mtp": True})["sequences"][0]["mtp_logits"]
        self.assertEqual(np.shape(full), (len(s) - 1, 97))
        for i in range(len(s) - 1):
            part = ref.run_request(model, {"sequences": [s[:i + 2]], "mtp": True})["sequences"][0]["mtp_logits"]
            self.assertClose(part[-1], full[i], 1e-5, f"position {i}")


class Errors(TmpDirCase):
    def _expect_error(self, folder, request, *needles):
        proc, _ = run_cli(folder, request, self.tmp)
        self.assertNotEqual(proc.returncode, 0)
        self.assertEqual(proc.stdout, "")
        for needle in needles:
            self.assertIn(needle, proc.stderr)

    def test_checkpoint_errors_name_the_tensor(self):
        cfg = tiny_config()
        w = generate_weights(cfg)
        missing = dict(w)
        del missing["model.layers.1.mlp.experts.3.up_proj.weight"]
        self._expect_error(self.model("missing", cfg, missing), {"sequences": [[1]]},
                           "model.layers.1.mlp.experts.3.up_proj.weight", "missing")
        bad = dict(w, **{"model.layers.0.self_attn.kv_b_proj.weight": np.zeros((5, 16), dtype=F32)})
        self._expect_error(self.model("shape", cfg, bad), {"sequences": [[1]]},
                           "model.layers.0.self_attn.kv_b_proj.weight", "shape")
        extra = dict(w, **{"model.layers.0.self_attn.q_a_proj.bias": np.zeros(24, dtype=F32)})
        self._expect_error(self.model("extra", cfg, extra), {"sequences": [[1]]}, "q_a_proj.bias")
        os.remove(os.path.join(self.tmp, "extra", "model.safetensors"))
        self._expect_error(os.path.join(self.tmp, "extra"), {"sequences": [[1]]}, "model.safetensors")

    def test_request_errors(self):
        folder = self.model("m", tiny_config())
        self._expect_error(folder, {"sequences": [[1, 97]]}, "97", "vocab_size")
        self._expect_error(folder, {"sequences": [[1]], "logits": True}, "unknown field")
        self._expect_error(folder, {"sequences": [[]]}, "sequences")
        self._expect_error(folder, {"sequences": [[1]], "greedy_tokens": -1}, "greedy_tokens")

    def test_config_errors(self):
        cfg = tiny_config()
        w = generate_weights(cfg)
        self._expect_error(self.model("arch", dict(cfg, architectures=["LlamaForCausalLM"]), w),
                           {"sequences": [[1]]}, "config.json", "architectures")
        self._expect_error(self.model("rope", dict(cfg, rope_scaling={"type": "linear", "factor": 2.0}), w),
                           {"sequences": [[1]]}, "rope_scaling")
        no_q = dict(cfg)
        del no_q["q_lora_rank"]
        self._expect_error(self.model("noq", no_q, w), {"sequences": [[1]]}, "q_lora_rank")


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
