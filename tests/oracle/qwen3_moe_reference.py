#!/usr/bin/python3
"""Independent float32 reference forward pass for Qwen3-MoE checkpoints (Qwen3MoeForCausalLM: the
Qwen3-30B-A3B / Qwen3-235B-A22B design).

Written from the published architecture (Qwen3 technical report; the fields of the Hugging Face
config.json) and sharing no code with the engine or with other projects. Run it with Debian's
interpreter, which has python3-torch 1.13 and python3-numpy:

    /usr/bin/python3 tests/oracle/qwen3_moe_reference.py MODEL_DIR REQUEST.json OUT.json

MODEL_DIR is a Hugging Face folder: config.json (architectures ["Qwen3MoeForCausalLM"]) and
model.safetensors or model.safetensors.index.json with its shards. Weights (F32, F64, BF16, F16) are
converted to float32 and every computation runs in float32.

REQUEST.json:
    {"sequences": [[token ids], ...],
     "all_logits": false,      # true: logits at every position; false: only at the last position
     "greedy_tokens": 0}       # greedy continuation of N tokens per sequence, by full recomputation
OUT.json:
    {"sequences": [{"logits": [[...], ...], "greedy": [ids], "greedy_margins": [m, ...]}, ...]}
"logits" has one row per requested position (all positions, or just the last); "greedy" is [] when
greedy_tokens is 0; "greedy_margins" has, per greedy token, how clear its choice was: (top logit -
second logit) / the largest |logit| of that row, so a caller with a relative logit tolerance can
tell a near-tie, where reduced-precision arithmetic may legitimately choose the other token, from a
wrong choice.

Architecture, per decoder layer (pre-norm residual blocks):
    h = x + o_proj(attention(RoPE(q_norm(q_proj n)), RoPE(k_norm(k_proj n)), v_proj n)),
        n = input_layernorm(x)
    out = h + ffn(post_attention_layernorm(h))
q_norm / k_norm are RMSNorms over head_dim applied to every head before RoPE; RoPE rotates the pairs
(x[i], x[i + head_dim/2]) (the "rotate half" / GPT-NeoX layout) over the whole head; attention is
causal grouped-query attention (query head h reads kv head h // (heads / kv_heads)) with scale
1/sqrt(head_dim). ffn is a MoE block (softmax router over all experts, top-k, optional
renormalisation, SwiGLU experts, no shared expert) or a dense SwiGLU MLP.

Errors go to stderr as one line naming the file, tensor or field, with a non-zero exit status;
nothing is ever printed on stdout.

Semantic choices are listed in tests/oracle/README.md.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

torch.set_num_threads(1)
torch.set_grad_enabled(False)

ARCHITECTURE = "Qwen3MoeForCausalLM"


class OracleError(Exception):
    """An error in the inputs (model folder, checkpoint or request), reported in one line."""


# ------------------------------------------------------------------------------------------------
# safetensors reading
# ------------------------------------------------------------------------------------------------

# safetensors dtype -> (numpy dtype of the stored bytes, bytes per element)
_STORED = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "F8_E4M3": ("u1", 1),
    "F8_E5M2": ("u1", 1),
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "I16": ("<i2", 2),
    "I32": ("<i4", 4),
    "I64": ("<i8", 8),
    "BOOL": ("u1", 1),
}

_WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")


class SafetensorsFile:
    """One .safetensors file: an 8-byte little-endian header length, a JSON header
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw
    little-endian tensor bytes, offsets relative to the end of the header."""

    def __init__(self, path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) != 8:
                    raise OracleError(f"{path}: file too short for a safetensors header")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > size - 8:
                    raise OracleError(f"{path}: header length {header_len} exceeds the file size {size}")
                header = json.loads(f.read(header_len).decode("utf-8"))
        except OSError as e:
            raise OracleError(f"{path}: cannot read: {e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OracleError(f"{path}: header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise OracleError(f"{path}: header is not a JSON object")
        self.data_start = 8 + header_len
        data_size = size - self.data_start
        self.entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = info["dtype"]
                shape = [int(d) for d in info["shape"]]
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise OracleError(f"{path}: tensor {name}: malformed header entry {info!r}") from None
            if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_size:
                raise OracleError(f"{path}: tensor {name}: offsets [{begin}, {end}] or shape {shape} "
                                  f"outside the {data_size}-byte data section")
            count = int(np.prod(shape, dtype=np.int64))
            if dtype in _STORED and end - begin != _STORED[dtype][1] * count:
                raise OracleError(f"{path}: tensor {name}: {end - begin} bytes do not hold a {dtype} "
                                  f"tensor of shape {shape}")
            self.entries[name] = (dtype, shape, begin, end)

    def read(self, name):
        """(stored values as a numpy array, bf16 as raw uint16; the safetensors dtype)."""
        dtype, shape, begin, end = self.entries[name]
        if dtype not in _WEIGHT_DTYPES:
            raise OracleError(f"{self.path}: tensor {name} has dtype {dtype}, which is not supported "
                              f"(F32, F64, BF16, F16)")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        if len(raw) != end - begin:
            raise OracleError(f"{self.path}: tensor {name}: file truncated")
        return np.frombuffer(raw, dtype=_STORED[dtype][0]).reshape(shape), dtype


class Checkpoint:
    """All tensors of a model folder: model.safetensors, or the shards listed by
    model.safetensors.index.json ("weight_map": {tensor name: shard file name})."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.location = {}  # tensor name -> SafetensorsFile
        self.used = set()
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        single_path = os.path.join(model_dir, "model.safetensors")
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise OracleError(f"{index_path}: cannot read weight_map: {e}") from None
            files = {}
            for name, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise OracleError(f"{index_path}: tensor {name} maps to {shard!r}, not a file name")
                if shard not in files:
                    shard_path = os.path.join(model_dir, shard)
                    if not os.path.exists(shard_path):
                        raise OracleError(f"{index_path}: shard {shard} (for tensor {name}) does not exist")
                    files[shard] = SafetensorsFile(shard_path)
                if name not in files[shard].entries:
                    raise OracleError(f"{index_path}: tensor {name} is mapped to {shard}, which does not hold it")
                self.location[name] = files[shard]
        elif os.path.exists(single_path):
            st = SafetensorsFile(single_path)
            for name in st.entries:
                self.location[name] = st
        else:
            raise OracleError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json exists")

    def has(self, name):
        return name in self.location

    def get(self, name, shape):
        """Tensor `name` as float32, checked against the expected shape and for NaN/inf."""
        if name not in self.location:
            raise OracleError(f"{self.model_dir}: tensor {name} is missing")
        st = self.location[name]
        raw, dtype = st.read(name)
        self.used.add(name)
        if list(raw.shape) != list(shape):
            raise OracleError(f"{st.path}: tensor {name} has shape {list(raw.shape)}, expected {list(shape)}")
        if dtype == "BF16":
            # bfloat16 is the high half of a float32
            values = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.astype(np.float32)
        if not np.all(np.isfinite(values)):
            raise OracleError(f"{st.path}: tensor {name} contains NaN or infinity")
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


# ------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------

_ROPE_SCALING_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings",
                      "beta_fast", "beta_slow", "truncate", "attention_factor", "mscale",
                      "mscale_all_dim"}


class Config:
    """The fields of config.json the forward pass needs, validated."""

    def __init__(self, path):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as e:
            raise OracleError(f"{path}: cannot read: {e}") from None
        except ValueError as e:
            raise OracleError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise OracleError(f"{path}: top level is not a JSON object")
        self.path = path
        self.raw = raw

        if "architectures" not in raw:
            raise OracleError(f"{path}: field architectures is missing (expected [\"{ARCHITECTURE}\"])")
        if raw["architectures"] != [ARCHITECTURE]:
            raise OracleError(f"{path}: field architectures = {raw['architectures']!r} is not [\"{ARCHITECTURE}\"]")

        # refusals of features this reference does not implement
        if self._bool("use_sliding_window", False):
            raise OracleError(f"{path}: field use_sliding_window = true is not supported")
        if self._bool("attention_bias", False):
            raise OracleError(f"{path}: field attention_bias = true is not supported (no q/k/v/o biases)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise OracleError(f"{path}: field hidden_act = {act!r} is not supported (only \"silu\")")
        if raw.get("quantization_config") is not None:
            raise OracleError(f"{path}: field quantization_config is set; quantised checkpoints are not supported")
        partial = raw.get("partial_rotary_factor", 1.0)
        if partial != 1 and partial != 1.0:
            raise OracleError(f"{path}: field partial_rotary_factor = {partial!r} is not supported (only 1)")

        self.vocab_size = self._int("vocab_size")
        self.hidden_size = self._int("hidden_size")
        self.num_hidden_layers = self._int("num_hidden_layers")
        self.num_attention_heads = self._int("num_attention_heads")
        self.num_key_value_heads = self._int("num_key_value_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise OracleError(f"{path}: field num_attention_heads = {self.num_attention_heads} is not a "
                              f"multiple of num_key_value_heads = {self.num_key_value_heads}")
        if raw.get("head_dim") is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
            if self.head_dim < 1:
                raise OracleError(f"{path}: field head_dim is missing and hidden_size // num_attention_heads is 0")
        else:
            self.head_dim = self._int("head_dim")
        if self.head_dim % 2:
            raise OracleError(f"{path}: field head_dim = {self.head_dim} is odd (RoPE needs pairs)")
        self.rms_norm_eps = self._float("rms_norm_eps")
        if self.rms_norm_eps < 0:
            raise OracleError(f"{path}: field rms_norm_eps = {self.rms_norm_eps} is negative")
        self.rope_theta = self._float("rope_theta")
        if self.rope_theta <= 1:
            raise OracleError(f"{path}: field rope_theta = {self.rope_theta} is not > 1")
        self.rope_scaling = raw.get("rope_scaling")
        self.max_position_embeddings = self._int("max_position_embeddings", 32768)
        self.tie_word_embeddings = self._bool("tie_word_embeddings", False)

        # which layers are MoE
        self.num_experts = self._int("num_experts", allow_zero=True)
        self.decoder_sparse_step = self._int("decoder_sparse_step", 1)
        mlp_only = raw.get("mlp_only_layers", [])
        if mlp_only is None:
            mlp_only = []
        if (not isinstance(mlp_only, list)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only)):
            raise OracleError(f"{path}: field mlp_only_layers = {mlp_only!r} is not a list of layer indices")
        for i in mlp_only:
            if not 0 <= i < self.num_hidden_layers:
                raise OracleError(f"{path}: field mlp_only_layers holds {i}, which is not a layer index "
                                  f"in [0, {self.num_hidden_layers})")
        self.mlp_only_layers = set(mlp_only)

        layers = range(self.num_hidden_layers)
        if any(not self.is_moe_layer(i) for i in layers):
            self.intermediate_size = self._int("intermediate_size")
        if any(self.is_moe_layer(i) for i in layers):
            self.moe_intermediate_size = self._int("moe_intermediate_size")
            self.num_experts_per_tok = self._int("num_experts_per_tok")
            if self.num_experts_per_tok > self.num_experts:
                raise OracleError(f"{path}: field num_experts_per_tok = {self.num_experts_per_tok} exceeds "
                                  f"num_experts = {self.num_experts}")
            if "norm_topk_prob" not in raw:
                raise OracleError(f"{path}: field norm_topk_prob is missing")
            self.norm_topk_prob = self._bool("norm_topk_prob")

    def _int(self, key, default=None, allow_zero=False):
        value = self.raw.get(key, default)
        if value is None:
            raise OracleError(f"{self.path}: field {key} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
            kind = "non-negative" if allow_zero else "positive"
            raise OracleError(f"{self.path}: field {key} = {value!r} is not a {kind} integer")
        return value

    def _float(self, key, default=None):
        value = self.raw.get(key, default)
        if value is None:
            raise OracleError(f"{self.path}: field {key} is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise OracleError(f"{self.path}: field {key} = {value!r} is not a number")
        return float(value)

    def _bool(self, key, default=None):
        value = self.raw.get(key, default)
        if value is None:
            raise OracleError(f"{self.path}: field {key} is missing")
        if not isinstance(value, bool):
            raise OracleError(f"{self.path}: field {key} = {value!r} is not true or false")
        return value

    def is_moe_layer(self, layer_idx):
        """MoE iff the layer is not in mlp_only_layers, experts exist and (i + 1) % decoder_sparse_step == 0."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


# ------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x, weight):
    return x @ weight.t()


def yarn_mscale(factor, mscale=1.0):
    """YaRN's magnitude 0.1 mscale ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor, attention_factor=None, mscale=None, mscale_all_dim=None):
    """YaRN's temperature, the multiplier of cos and sin: the config's attention_factor if given,
    else yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) when both are given and
    non-zero, else yarn_mscale(factor)."""
    if attention_factor is not None:
        return attention_factor
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class Rope:
    """Rotary embedding over the whole head_dim in the rotate-half layout: for i < d/2 the pair
    (x[i], x[i + d/2]) rotates by the angle position * inv_freq[i], inv_freq[i] = theta^(-2i/d).

    YaRN (rope_scaling type "yarn"): each frequency is blended between itself (extrapolation) and
    itself / factor (interpolation) by a ramp over the dimension-pair index, 0 below
    low = floor(c(beta_fast)) and 1 above high = ceil(c(beta_slow)) (not rounded with truncate
    false), clamped to [0, d - 1], where c(r) = d * ln(original_max_position_embeddings / (2 pi r)) /
    (2 ln theta) is the pair index whose wavelength fits r times in the original context
    (max_position_embeddings when not given); the weight of the interpolated frequency is the ramp.
    cos and sin are multiplied by yarn_attention_factor(...) of the rope_scaling fields."""

    def __init__(self, cfg):
        dim = cfg.head_dim
        base = cfg.rope_theta
        inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        self.scale = 1.0
        self.correction_range = None
        scaling = cfg.rope_scaling
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise OracleError(f"{cfg.path}: field rope_scaling = {scaling!r} is not an object or null")
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "yarn":
                raise OracleError(f"{cfg.path}: field rope_scaling type {kind!r} is not supported (only yarn)")
            for key in sorted(scaling):
                if key not in _ROPE_SCALING_KEYS:
                    raise OracleError(f"{cfg.path}: field rope_scaling.{key} is not supported")
            truncate = scaling.get("truncate", True)
            if not isinstance(truncate, bool):
                raise OracleError(f"{cfg.path}: field rope_scaling.truncate = {truncate!r} is not a boolean")

            def number(key, default=None):
                value = scaling.get(key, default)
                if value is None:
                    raise OracleError(f"{cfg.path}: field rope_scaling.{key} is missing")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise OracleError(f"{cfg.path}: field rope_scaling.{key} = {value!r} is not a number")
                return float(value)
            factor = number("factor")
            if factor < 1:
                raise OracleError(f"{cfg.path}: field rope_scaling.factor = {factor} is below 1")
            original = number("original_max_position_embeddings", getattr(cfg, "max_position_embeddings", None))
            beta_fast = number("beta_fast", 32)
            beta_slow = number("beta_slow", 1)
            if original <= 0 or beta_fast <= 0 or beta_slow <= 0:
                raise OracleError(f"{cfg.path}: field rope_scaling: original_max_position_embeddings, "
                                  f"beta_fast and beta_slow must be positive")

            def pair_index(rotations):
                return dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(base))

            low, high = pair_index(beta_fast), pair_index(beta_slow)
            if truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            self.correction_range = (low, high)
            if high == low:
                high += 0.001  # avoid a zero-width ramp
            ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
            inv_freq = inv_freq * (1.0 - ramp) + (inv_freq / factor) * ramp
            optional = {key: number(key) for key in ("attention_factor", "mscale", "mscale_all_dim")
                        if scaling.get(key) is not None}
            self.scale = yarn_attention_factor(factor, **optional)
        self.inv_freq = inv_freq

    def cos_sin(self, positions):
        """float32 cos and sin, [len(positions), head_dim / 2], angles computed in float64."""
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        cos = torch.from_numpy((np.cos(angles) * self.scale).astype(np.float32))
        sin = torch.from_numpy((np.sin(angles) * self.scale).astype(np.float32))
        return cos, sin

    @staticmethod
    def apply(x, cos, sin):
        """x [..., d] with cos/sin broadcastable to [..., d / 2]."""
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Mlp:
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, ck, prefix, hidden, inter):
        self.gate = ck.get(prefix + "gate_proj.weight", [inter, hidden])
        self.up = ck.get(prefix + "up_proj.weight", [inter, hidden])
        self.down = ck.get(prefix + "down_proj.weight", [hidden, inter])

    def __call__(self, x):
        return linear(torch.nn.functional.silu(linear(x, self.gate)) * linear(x, self.up), self.down)


def top_indices(scores, k):
    """Indices of the k largest entries per row, largest first; ties go to the lower index."""
    order = np.argsort(-scores.numpy(), axis=-1, kind="stable")[:, :k]
    return torch.from_numpy(np.ascontiguousarray(order))


class Router:
    """Softmax over the router logits of all experts (float32), the top num_experts_per_tok chosen
    (ties: lower index), their probabilities renormalised to sum 1 when norm_topk_prob."""

    def __init__(self, cfg, ck, prefix):
        self.cfg = cfg
        self.weight = ck.get(prefix + "weight", [cfg.num_experts, cfg.hidden_size])

    def route(self, logits):
        probs = torch.softmax(logits.float(), dim=-1)
        indices = top_indices(probs, self.cfg.num_experts_per_tok)
        weights = probs.gather(1, indices)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights

    def __call__(self, x):
        return self.route(linear(x.float(), self.weight))


class Moe:
    """Sum over the chosen experts of weight * expert(x); no shared expert."""

    def __init__(self, cfg, ck, prefix):
        self.router = Router(cfg, ck, prefix + "gate.")
        self.experts = [Mlp(ck, f"{prefix}experts.{e}.", cfg.hidden_size, cfg.moe_intermediate_size)
                        for e in range(cfg.num_experts)]

    def __call__(self, x):
        indices, weights = self.router(x)
        out = torch.zeros_like(x)
        for e in torch.unique(indices).tolist():
            tokens, slot = torch.nonzero(indices == e, as_tuple=True)
            out.index_add_(0, tokens, self.experts[e](x[tokens]) * weights[tokens, slot].unsqueeze(-1))
        return out


class Attention:
    """Causal grouped-query attention with per-head q/k RMSNorm before RoPE."""

    def __init__(self, cfg, ck, prefix, rope):
        self.cfg = cfg
        self.rope = rope
        h, kv, d, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = ck.get(prefix + "q_proj.weight", [h * d, hidden])
        self.k_proj = ck.get(prefix + "k_proj.weight", [kv * d, hidden])
        self.v_proj = ck.get(prefix + "v_proj.weight", [kv * d, hidden])
        self.o_proj = ck.get(prefix + "o_proj.weight", [hidden, h * d])
        self.q_norm = ck.get(prefix + "q_norm.weight", [d])
        self.k_norm = ck.get(prefix + "k_norm.weight", [d])
        # query head i reads kv head i // (heads / kv_heads)
        self.kv_of_head = torch.arange(h) // (h // kv)
        self.scale = 1.0 / math.sqrt(d)

    def __call__(self, x, positions):
        cfg = self.cfg
        t = x.shape[0]
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        q = rms_norm(linear(x, self.q_proj).view(t, h, d), self.q_norm, eps)
        k = rms_norm(linear(x, self.k_proj).view(t, kv, d), self.k_norm, eps)
        v = linear(x, self.v_proj).view(t, kv, d)
        cos, sin = self.rope.cos_sin(positions)
        q = Rope.apply(q, cos.unsqueeze(1), sin.unsqueeze(1))
        k = Rope.apply(k, cos.unsqueeze(1), sin.unsqueeze(1))
        k = k.index_select(1, self.kv_of_head)  # [T, h, d]
        v = v.index_select(1, self.kv_of_head)
        pos = torch.tensor(list(positions))
        causal = pos[None, :] <= pos[:, None]  # [query, key]
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        scores = scores.masked_fill(~causal.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        return linear(out.reshape(t, h * d), self.o_proj)


class DecoderLayer:
    def __init__(self, cfg, ck, layer_idx, rope):
        prefix = f"model.layers.{layer_idx}."
        self.eps = cfg.rms_norm_eps
        self.input_norm = ck.get(prefix + "input_layernorm.weight", [cfg.hidden_size])
        self.post_attention_norm = ck.get(prefix + "post_attention_layernorm.weight", [cfg.hidden_size])
        self.attn = Attention(cfg, ck, prefix + "self_attn.", rope)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = Moe(cfg, ck, prefix + "mlp.")
        else:
            self.mlp = Mlp(ck, prefix + "mlp.", cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x, positions):
        x = x + self.attn(rms_norm(x, self.input_norm, self.eps), positions)
        return x + self.mlp(rms_norm(x, self.post_attention_norm, self.eps))


class Model:
    def __init__(self, model_dir):
        self.cfg = cfg = Config(os.path.join(model_dir, "config.json"))
        self.ck = ck = Checkpoint(model_dir)
        self.rope = Rope(cfg)
        hidden = cfg.hidden_size
        self.embed = ck.get("model.embed_tokens.weight", [cfg.vocab_size, hidden])
        self.layers = [DecoderLayer(cfg, ck, i, self.rope) for i in range(cfg.num_hidden_layers)]
        self.norm = ck.get("model.norm.weight", [hidden])
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
            if ck.has("lm_head.weight"):
                ck.used.add("lm_head.weight")  # ignored: the output embedding is the input one
        else:
            self.lm_head = ck.get("lm_head.weight", [cfg.vocab_size, hidden])
        self._check_unused()

    def _check_unused(self):
        """Every stored tensor must be one the architecture reads, so a misnamed or extra tensor
        (a bias, an expert of a dense layer, a shared expert) is an error, not silently ignored."""
        unused = sorted(n for n in self.ck.location
                        if n not in self.ck.used and not n.endswith("rotary_emb.inv_freq"))
        if unused:
            more = f" (and {len(unused) - 10} more)" if len(unused) > 10 else ""
            raise OracleError(f"{self.ck.model_dir}: tensors not used by the {ARCHITECTURE} architecture "
                              f"described by config.json: {', '.join(unused[:10])}{more}")

    def check_tokens(self, tokens):
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size:
                raise OracleError(f"request: token id {t!r} is not in [0, vocab_size {self.cfg.vocab_size})")

    def hidden(self, tokens):
        """Hidden states after the last decoder layer (before the final norm), positions 0..len-1."""
        positions = list(range(len(tokens)))
        x = self.embed[torch.tensor(tokens, dtype=torch.long)]
        for layer in self.layers:
            x = layer(x, positions)
        return x

    def logits(self, hidden):
        return linear(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head)


# ------------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------------

def greedy_argmax(row):
    """Index of the largest logit; ties go to the lowest index."""
    return int(np.argmax(row.numpy()))


def greedy_margin(row):
    """(top logit - second logit) / largest |logit|: how clear the greedy choice of this row is."""
    values = row.numpy().astype(np.float64)
    if values.size < 2:
        return 0.0
    top2 = np.sort(values)[-2:]
    scale = float(np.max(np.abs(values)))
    return float((top2[1] - top2[0]) / scale) if scale > 0 else 0.0


def finite_rows(tensor, what):
    if not torch.isfinite(tensor).all():
        raise OracleError(f"{what} contain NaN or infinity")
    return tensor.tolist()


def parse_request(req):
    if not isinstance(req, dict):
        raise OracleError("request: top level is not a JSON object")
    unknown = sorted(set(req) - {"sequences", "all_logits", "greedy_tokens"})
    if unknown:
        raise OracleError(f"request: unknown field(s) {unknown}")
    seqs = req.get("sequences")
    if not isinstance(seqs, list) or not all(isinstance(s, list) and s for s in seqs):
        raise OracleError("request: sequences must be a list of non-empty lists of token ids")
    all_logits = req.get("all_logits", False)
    if not isinstance(all_logits, bool):
        raise OracleError("request: all_logits must be true or false")
    greedy = req.get("greedy_tokens", 0)
    if isinstance(greedy, bool) or not isinstance(greedy, int) or greedy < 0:
        raise OracleError("request: greedy_tokens must be a non-negative integer")
    return seqs, all_logits, greedy


def run_request(model, req):
    seqs, all_logits, greedy_n = parse_request(req)
    for tokens in seqs:
        model.check_tokens(tokens)
    out = []
    for n, tokens in enumerate(seqs):
        hidden = model.hidden(tokens)
        rows = hidden if all_logits else hidden[-1:]
        entry = {"logits": finite_rows(model.logits(rows), f"sequence {n}: logits"), "greedy": [],
                 "greedy_margins": []}
        if greedy_n:
            ids = list(tokens)
            row = model.logits(hidden[-1:])[0]
            for step in range(greedy_n):
                if not torch.isfinite(row).all():
                    raise OracleError(f"sequence {n}: greedy step {step}: logits contain NaN or infinity")
                nxt = greedy_argmax(row)
                ids.append(nxt)
                entry["greedy"].append(nxt)
                entry["greedy_margins"].append(greedy_margin(row))
                if step + 1 < greedy_n:  # full recomputation over the whole sequence so far
                    row = model.logits(model.hidden(ids)[-1:])[0]
        out.append(entry)
    return {"sequences": out}


def write_response(result, f):
    """JSON with each float32 written in 9 significant digits, which round-trip to the same float32
    (also through a double) at a third less size and time than json's 17-digit doubles."""
    fmt = "{:.9g}".format

    def matrix(rows):
        return "[" + ",".join("[" + ",".join(map(fmt, row)) + "]" for row in rows) + "]"
    f.write('{"sequences":[')
    for n, seq in enumerate(result["sequences"]):
        f.write(("," if n else "") + '{"logits":' + matrix(seq["logits"]) + ',"greedy":'
                + json.dumps(seq["greedy"]) + ',"greedy_margins":' + json.dumps(seq["greedy_margins"]) + "}")
    f.write("]}\n")


def main(argv):
    if len(argv) != 4:
        sys.stderr.write("usage: qwen3_moe_reference.py MODEL_DIR REQUEST.json OUT.json\n")
        return 2
    model_dir, req_path, out_path = argv[1:]
    try:
        try:
            with open(req_path, encoding="utf-8") as f:
                req = json.load(f)
        except OSError as e:
            raise OracleError(f"{req_path}: cannot read: {e}") from None
        except ValueError as e:
            raise OracleError(f"{req_path}: not valid JSON: {e}") from None
        parse_request(req)  # request errors before the (possibly slow) model load
        if not os.path.isdir(model_dir):
            raise OracleError(f"{model_dir}: not a directory")
        model = Model(model_dir)
        result = run_request(model, req)
        tmp = out_path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                write_response(result, f)
            os.replace(tmp, out_path)
        except OSError as e:
            raise OracleError(f"{out_path}: cannot write: {e}") from None
    except OracleError as e:
        sys.stderr.write(f"qwen3_moe_reference: error: {' '.join(str(e).split())}\n")
        return 1
    except MemoryError:
        sys.stderr.write(f"qwen3_moe_reference: error: {model_dir}: out of memory loading the checkpoint in float32\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
