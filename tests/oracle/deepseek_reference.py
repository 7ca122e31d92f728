#!/usr/bin/python3
"""Independent float32 reference forward pass for DeepSeek-V2/V3-family checkpoints (the model oracle).

Tandem's C++ engine is tested against this script. It is written from the published architecture
(DeepSeek-V2/V3 papers; shared/reference/kernels-engine.md section 3) and shares no code with the
engine. Run it with Debian's interpreter, which has python3-torch 1.13 and python3-numpy:

    /usr/bin/python3 tests/oracle/deepseek_reference.py MODEL_DIR REQUEST.json OUT.json

MODEL_DIR is a Hugging Face folder: config.json (DeepseekV3ForCausalLM or DeepseekV2ForCausalLM) and
model.safetensors or model.safetensors.index.json with shards. Weights are dequantised to float32
(F32, F64, BF16, F16, F8_E4M3 with block `weight_scale_inv`, I8 with per-row `weight_scale`) and every
computation runs in float32.

REQUEST.json:
    {"sequences": [[token ids], ...],
     "all_logits": false,      # true: logits at every position; false: only at the last position
     "greedy_tokens": 0,       # greedy continuation of N tokens per sequence, by full recomputation
     "greedy_masked": [],      # optional: ids the greedy continuation never chooses
     "mtp": false,             # MTP logits for positions 0..len-2 (draft of token i+2, fed token i+1)
     "attention": "naive",     # optional: "naive" (per-head K/V) or "absorbed" (latent MQA form)
     "mtp_mask_position0": false}  # optional: zero the MTP input embedding at position 0 as vLLM does
OUT.json:
    {"sequences": [{"logits": [[...], ...], "greedy": [ids], "greedy_margins": [m, ...],
                    "mtp_logits": [[...], ...]}, ...]}
"logits" has one row per requested position (all positions, or just the last); "greedy" is [] when
greedy_tokens is 0; "greedy_margins" has, per greedy token, how clear its choice was: (top logit -
second logit) / the largest |logit| of that row, so a caller with a relative logit tolerance can
tell a near-tie, where reduced-precision arithmetic may legitimately choose the other token, from a
wrong choice; "mtp_logits" is [] when mtp is false (and for one-token sequences).

Errors go to stderr as one line naming the file, tensor or field, with a non-zero exit status;
nothing is ever printed on stdout.

Semantic choices (each with its source) are listed in tests/oracle/README.md.
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
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "I16": ("<i2", 2),
    "I32": ("<i4", 4),
    "I64": ("<i8", 8),
}


def _fp8_e4m3fn_table():
    """Value of each of the 256 float8 e4m3fn bit patterns (OCP FP8: bias 7, no infinities,
    S.1111.111 is NaN, exponent 0 is subnormal m/8 * 2^-6)."""
    table = np.empty(256, dtype=np.float32)
    for bits in range(256):
        sign = -1.0 if bits & 0x80 else 1.0
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        if exponent == 0xF and mantissa == 0x7:
            value = float("nan")
        elif exponent == 0:
            value = sign * (mantissa / 8.0) * 2.0 ** -6
        else:
            value = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
        table[bits] = value
    return table


FP8_E4M3_TABLE = _fp8_e4m3fn_table()


class SafetensorsFile:
    """One .safetensors file: 8-byte little-endian header length, JSON header, raw data."""

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
            if dtype in _STORED and end - begin != _STORED[dtype][1] * int(np.prod(shape, dtype=np.int64)):
                raise OracleError(f"{path}: tensor {name}: {end - begin} bytes do not hold a {dtype} "
                                  f"tensor of shape {shape}")
            self.entries[name] = (dtype, shape, begin, end)

    def read(self, name):
        """The stored values as a numpy array (bf16 as raw uint16, fp8 as raw uint8) and the dtype."""
        dtype, shape, begin, end = self.entries[name]
        if dtype not in _STORED:
            raise OracleError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        if len(raw) != end - begin:
            raise OracleError(f"{self.path}: tensor {name}: file truncated")
        return np.frombuffer(raw, dtype=_STORED[dtype][0]).reshape(shape), dtype


class Checkpoint:
    """All tensors of a model folder: model.safetensors, or shards listed by
    model.safetensors.index.json ("weight_map": {tensor name: shard file name})."""

    def __init__(self, model_dir, block_size=(128, 128)):
        self.model_dir = model_dir
        self.block_size = block_size
        self.location = {}  # tensor name -> SafetensorsFile
        self.used = set()
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        single_path = os.path.join(model_dir, "model.safetensors")
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise OracleError(f"{index_path}: cannot read weight_map: {e}") from None
            files = {}
            for name, shard in weight_map.items():
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
        """Tensor `name` as float32 (dequantised), checked against the expected shape."""
        if name not in self.location:
            raise OracleError(f"{self.model_dir}: tensor {name} is missing")
        st = self.location[name]
        raw, dtype = st.read(name)
        self.used.add(name)
        if list(raw.shape) != list(shape):
            raise OracleError(f"{st.path}: tensor {name} has shape {list(raw.shape)}, expected {list(shape)}")
        if dtype == "BF16":
            values = (raw.astype(np.uint32) << 16).view(np.float32)
        elif dtype == "F8_E4M3":
            values = self._dequant_fp8(name, raw)
        elif dtype == "I8":
            values = self._dequant_i8(name, raw)
        elif dtype in ("F64", "F32", "F16"):
            values = raw.astype(np.float32)
        else:
            raise OracleError(f"{st.path}: tensor {name} has dtype {dtype}, which is not a weight dtype")
        if not np.all(np.isfinite(values)):
            raise OracleError(f"{st.path}: tensor {name} contains NaN or infinity")
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def _scale_name(self, weight_name, suffix):
        if not weight_name.endswith(".weight"):
            raise OracleError(f"{self.location[weight_name].path}: quantised tensor {weight_name} "
                              f"is not a `.weight`, so it has no {suffix}")
        scale_name = weight_name[: -len(".weight")] + "." + suffix
        if scale_name not in self.location:
            raise OracleError(f"{self.location[weight_name].path}: quantised tensor {weight_name} "
                              f"has no {scale_name}")
        return scale_name

    def _dequant_fp8(self, name, raw):
        """W[i, j] = fp8(W)[i, j] * weight_scale_inv[i // block_rows, j // block_cols]."""
        if raw.ndim != 2:
            raise OracleError(f"{self.location[name].path}: FP8 tensor {name} is not 2-D")
        rows, cols = raw.shape
        br, bc = self.block_size
        scale_name = self._scale_name(name, "weight_scale_inv")
        scale = self.get(scale_name, [-(-rows // br), -(-cols // bc)]).numpy()
        full = np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:rows, :cols]
        return FP8_E4M3_TABLE[raw] * full

    def _dequant_i8(self, name, raw):
        """W[i, j] = int8(W)[i, j] * weight_scale[i] (per output channel, stored [out, 1] or [out])."""
        if raw.ndim != 2:
            raise OracleError(f"{self.location[name].path}: I8 tensor {name} is not 2-D")
        scale_name = self._scale_name(name, "weight_scale")
        stored_shape = self.location[scale_name].entries[scale_name][1]
        shape = [raw.shape[0]] if len(stored_shape) == 1 else [raw.shape[0], 1]
        scale = self.get(scale_name, shape).numpy().reshape(-1, 1)
        return raw.astype(np.float32) * scale


# ------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------

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
        self.path = path
        self.raw = raw

        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if "DeepseekV3ForCausalLM" in archs or (not archs and model_type == "deepseek_v3"):
            self.arch = "v3"
        elif "DeepseekV2ForCausalLM" in archs or (not archs and model_type == "deepseek_v2"):
            self.arch = "v2"
        else:
            raise OracleError(f"{path}: architectures {archs} (model_type {model_type!r}) is not "
                              f"DeepseekV3ForCausalLM or DeepseekV2ForCausalLM")
        v3 = self.arch == "v3"

        self.vocab_size = self._int("vocab_size")
        self.hidden_size = self._int("hidden_size")
        self.intermediate_size = self._int("intermediate_size")
        self.num_hidden_layers = self._int("num_hidden_layers")
        self.num_attention_heads = self._int("num_attention_heads")
        if "q_lora_rank" not in raw:
            raise OracleError(f"{path}: field q_lora_rank is missing (null means no q-LoRA)")
        self.q_lora_rank = self._int("q_lora_rank") if raw["q_lora_rank"] is not None else None
        self.kv_lora_rank = self._int("kv_lora_rank")
        self.qk_nope_head_dim = self._int("qk_nope_head_dim")
        self.qk_rope_head_dim = self._int("qk_rope_head_dim")
        self.v_head_dim = self._int("v_head_dim")
        if self.qk_rope_head_dim % 2:
            raise OracleError(f"{path}: qk_rope_head_dim {self.qk_rope_head_dim} is odd")
        self.rms_norm_eps = self._float("rms_norm_eps", 1e-6)
        self.rope_theta = self._float("rope_theta", 10000.0)
        self.rope_scaling = raw.get("rope_scaling")
        self.max_position_embeddings = self._int("max_position_embeddings", 4096 if v3 else 2048)
        self.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
        self.num_nextn_predict_layers = self._int("num_nextn_predict_layers", 0, allow_zero=True)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise OracleError(f"{path}: hidden_act {act!r} is not supported (only silu)")
        if raw.get("attention_bias", False):
            raise OracleError(f"{path}: attention_bias true is not supported")

        # MoE (n_routed_experts null = a dense model)
        self.n_routed_experts = raw.get("n_routed_experts")
        if self.n_routed_experts is not None:
            self.n_routed_experts = self._int("n_routed_experts")
            self.moe_intermediate_size = self._int("moe_intermediate_size")
            self.num_experts_per_tok = self._int("num_experts_per_tok")
            shared = raw.get("n_shared_experts")
            self.n_shared_experts = self._int("n_shared_experts", allow_zero=True) if shared is not None else 0
            self.n_group = self._int("n_group") if raw.get("n_group") is not None else 1
            self.topk_group = self._int("topk_group") if raw.get("topk_group") is not None else self.n_group
            self.scoring_func = raw.get("scoring_func", "sigmoid" if v3 else "softmax")
            self.topk_method = raw.get("topk_method", "noaux_tc" if v3 else "greedy")
            if self.topk_method == "gready":  # DeepseekV2Config's default spelling
                self.topk_method = "greedy"
            self.norm_topk_prob = bool(raw.get("norm_topk_prob", v3))
            self.routed_scaling_factor = self._float("routed_scaling_factor", 1.0)
            self.first_k_dense_replace = self._int("first_k_dense_replace", 0, allow_zero=True)
            self.moe_layer_freq = self._int("moe_layer_freq", 1)
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise OracleError(f"{path}: scoring_func {self.scoring_func!r} is not softmax or sigmoid")
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise OracleError(f"{path}: topk_method {self.topk_method!r} is not greedy, "
                                  f"group_limited_greedy or noaux_tc")
            if self.n_routed_experts % self.n_group:
                raise OracleError(f"{path}: n_routed_experts {self.n_routed_experts} is not a multiple "
                                  f"of n_group {self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise OracleError(f"{path}: topk_group {self.topk_group} is not in [1, n_group {self.n_group}]")
            grouped = self.topk_method != "greedy" and self.n_group > 1
            candidates = (self.topk_group * (self.n_routed_experts // self.n_group) if grouped
                          else self.n_routed_experts)
            if not 1 <= self.num_experts_per_tok <= candidates:
                raise OracleError(f"{path}: num_experts_per_tok {self.num_experts_per_tok} is not in "
                                  f"[1, {candidates}] (experts in the selected groups)")
            if (self.topk_method == "noaux_tc" and self.n_group > 1
                    and self.n_routed_experts // self.n_group < 2):
                raise OracleError(f"{path}: noaux_tc group scores need at least 2 experts per group")

        quant = raw.get("quantization_config") or {}
        block = quant.get("weight_block_size") or [128, 128]
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise OracleError(f"{path}: quantization_config.weight_block_size {block!r} is not [rows, cols]")
        self.weight_block_size = tuple(block)

    def _int(self, key, default=None, allow_zero=False):
        value = self.raw.get(key, default)
        if value is None:
            raise OracleError(f"{self.path}: field {key} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
            raise OracleError(f"{self.path}: field {key} = {value!r} is not a {'non-negative' if allow_zero else 'positive'} integer")
        return value

    def _float(self, key, default=None):
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OracleError(f"{self.path}: field {key} = {value!r} is not a number")
        return float(value)

    def is_moe_layer(self, layer_idx):
        """HF DeepseekV2/V3DecoderLayer (and vLLM): MoE when experts exist, layer_idx >=
        first_k_dense_replace and layer_idx % moe_layer_freq == 0. MTP layers use their stored index."""
        return (self.n_routed_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)


# ------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek model.py and HF build them with eps 1e-6


def rms_norm(x, weight, eps):
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(x, weight):
    return x @ weight.t()


def yarn_get_mscale(scale, mscale):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class Rope:
    """Rotary embedding of the qk_rope_head_dim part, DeepSeek style: consecutive pairs
    (x[2i], x[2i+1]) rotate by position * inv_freq[i] (model.py apply_rotary_emb's complex product;
    vLLM is_neox_style=False). With YaRN, inv_freq blends interpolated and extrapolated frequencies over
    the correction range, cos/sin carry yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim),
    and the softmax scale gains yarn_get_mscale(f, mscale_all_dim)^2 (HF / vLLM)."""

    def __init__(self, cfg):
        dim = cfg.qk_rope_head_dim
        base = cfg.rope_theta
        inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        self.cos_sin_scale = 1.0
        self.softmax_scale_factor = 1.0
        scaling = cfg.rope_scaling
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise OracleError(f"{cfg.path}: rope_scaling {scaling!r} is not an object or null")
            kind = scaling.get("type", scaling.get("rope_type"))
            if kind != "yarn":
                raise OracleError(f"{cfg.path}: rope_scaling type {kind!r} is not supported (only yarn)")
            if "factor" not in scaling:
                raise OracleError(f"{cfg.path}: rope_scaling.factor is missing")
            factor = float(scaling["factor"])
            original = float(scaling.get("original_max_position_embeddings", 4096))
            beta_fast = float(scaling.get("beta_fast", 32))
            beta_slow = float(scaling.get("beta_slow", 1))
            mscale = float(scaling.get("mscale", 1))
            mscale_all_dim = float(scaling.get("mscale_all_dim", 0))

            def correction_dim(rotations):
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
            extrapolated = 1.0 - ramp  # weight of the original frequency
            inv_freq = inv_freq / factor * ramp + inv_freq * extrapolated
            self.cos_sin_scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
            if mscale_all_dim:
                self.softmax_scale_factor = yarn_get_mscale(factor, mscale_all_dim) ** 2
        self.inv_freq = inv_freq

    def cos_sin(self, positions):
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        cos = torch.from_numpy((np.cos(angles) * self.cos_sin_scale).astype(np.float32))
        sin = torch.from_numpy((np.sin(angles) * self.cos_sin_scale).astype(np.float32))
        return cos, sin

    @staticmethod
    def apply(x, cos, sin):
        """x [..., rope_dim] with cos/sin broadcastable to [..., rope_dim / 2]."""
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


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
    """DeepSeekMoE gate, in float32. Scores = softmax or sigmoid of the gate logits. Selection score =
    score + e_score_correction_bias for noaux_tc, else the score. With group limiting (noaux_tc or
    group_limited_greedy, n_group > 1), groups rank by the sum of their top-2 selection scores (noaux_tc)
    or their maximum (group_limited_greedy); experts outside the topk_group best groups are excluded
    (-inf). The top_k selection scores choose the experts; their weights are the unbiased scores,
    normalised to sum 1 when norm_topk_prob and top_k > 1, then times routed_scaling_factor."""

    def __init__(self, cfg, ck, prefix):
        self.cfg = cfg
        e = cfg.n_routed_experts
        self.weight = ck.get(prefix + "weight", [e, cfg.hidden_size])
        bias_name = prefix + "e_score_correction_bias"
        self.bias = None
        if cfg.topk_method == "noaux_tc":
            self.bias = ck.get(bias_name, [e])
        elif ck.has(bias_name):
            ck.used.add(bias_name)  # present but unused by this topk_method (as in HF)

    def __call__(self, x):
        cfg = self.cfg
        logits = linear(x.float(), self.weight)
        scores = torch.softmax(logits, dim=-1) if cfg.scoring_func == "softmax" else torch.sigmoid(logits)
        choice = scores + self.bias if self.bias is not None else scores.clone()
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            n = choice.shape[0]
            grouped = choice.view(n, cfg.n_group, -1)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = top_indices(group_scores, cfg.topk_group)
            excluded = torch.ones(n, cfg.n_group, dtype=torch.bool)
            excluded.scatter_(1, keep, False)
            choice = grouped.masked_fill(excluded.unsqueeze(-1), float("-inf")).view(n, -1)
        indices = top_indices(choice, cfg.num_experts_per_tok)
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights * cfg.routed_scaling_factor


class Moe:
    def __init__(self, cfg, ck, prefix):
        self.router = Router(cfg, ck, prefix + "gate.")
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.experts = [Mlp(ck, f"{prefix}experts.{i}.", hidden, inter) for i in range(cfg.n_routed_experts)]
        self.shared = (Mlp(ck, prefix + "shared_experts.", hidden, inter * cfg.n_shared_experts)
                       if cfg.n_shared_experts else None)

    def __call__(self, x):
        indices, weights = self.router(x)
        out = torch.zeros_like(x)
        for e in torch.unique(indices).tolist():
            tokens, slot = torch.nonzero(indices == e, as_tuple=True)
            out.index_add_(0, tokens, self.experts[e](x[tokens]) * weights[tokens, slot].unsqueeze(-1))
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class Attention:
    """Multi-head latent attention (MLA).

    q = q_b_proj(q_a_layernorm(q_a_proj x)) (or q_proj x), per head [nope | rope]; kv_a_proj_with_mqa x =
    [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]; c = kv_a_layernorm(latent); k_rope is shared by
    all heads. "naive": kv_b_proj c = per head [k_nope | v], standard attention over [k_nope | k_rope].
    "absorbed": q_nope is folded into the latent space through W_UK, scores = q_hat . c + q_rope . k_rope,
    the output latent is mapped back through W_UV (kernels-engine.md 3.2; model.py attn_impl="absorb")."""

    def __init__(self, cfg, ck, prefix, rope):
        self.cfg = cfg
        self.rope = rope
        h, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        hidden = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = ck.get(prefix + "q_proj.weight", [h * (dn + dr), hidden])
        else:
            self.q_a = ck.get(prefix + "q_a_proj.weight", [cfg.q_lora_rank, hidden])
            self.q_a_norm = ck.get(prefix + "q_a_layernorm.weight", [cfg.q_lora_rank])
            self.q_b = ck.get(prefix + "q_b_proj.weight", [h * (dn + dr), cfg.q_lora_rank])
        self.kv_a = ck.get(prefix + "kv_a_proj_with_mqa.weight", [r + dr, hidden])
        self.kv_a_norm = ck.get(prefix + "kv_a_layernorm.weight", [r])
        self.kv_b = ck.get(prefix + "kv_b_proj.weight", [h * (dn + dv), r])
        self.o_proj = ck.get(prefix + "o_proj.weight", [hidden, h * dv])
        self.softmax_scale = (dn + dr) ** -0.5 * rope.softmax_scale_factor

    def latent(self, x, positions):
        """Per-token cache entry: (c [T, kv_lora_rank], rotated k_rope [T, qk_rope_head_dim])."""
        r = self.cfg.kv_lora_rank
        kv = linear(x, self.kv_a)
        c = rms_norm(kv[:, :r], self.kv_a_norm, LATENT_NORM_EPS)
        cos, sin = self.rope.cos_sin(positions)
        return c, Rope.apply(kv[:, r:], cos, sin)

    def queries(self, x, positions):
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = linear(x, self.q_proj)
        else:
            q = linear(rms_norm(linear(x, self.q_a), self.q_a_norm, LATENT_NORM_EPS), self.q_b)
        q = q.view(x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        cos, sin = self.rope.cos_sin(positions)
        q_rope = Rope.apply(q[..., cfg.qk_nope_head_dim:], cos.unsqueeze(1), sin.unsqueeze(1))
        return q[..., :cfg.qk_nope_head_dim], q_rope

    def __call__(self, x, positions, past=None, mode="naive"):
        """x [T, hidden] at `positions`; past = (c, k_rope, positions) of earlier tokens (the cache).
        Returns (output [T, hidden], (c, k_rope) of these tokens)."""
        cfg = self.cfg
        h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_nope, q_rope = self.queries(x, positions)
        c_new, k_rope_new = self.latent(x, positions)
        c, k_rope, key_pos = c_new, k_rope_new, list(positions)
        if past is not None and past[0].shape[0]:
            c = torch.cat([past[0], c_new])
            k_rope = torch.cat([past[1], k_rope_new])
            key_pos = list(past[2]) + key_pos
        causal = torch.tensor(key_pos)[None, :] <= torch.tensor(list(positions))[:, None]  # [Tq, Tk]

        w_kv_b = self.kv_b.view(h, dn + dv, r)
        w_uk, w_uv = w_kv_b[:, :dn, :], w_kv_b[:, dn:, :]
        if mode == "naive":
            kv = linear(c, self.kv_b).view(-1, h, dn + dv)
            k_nope, v = kv[..., :dn], kv[..., dn:]
            scores = (torch.einsum("qhd,khd->hqk", q_nope, k_nope)
                      + torch.einsum("qhd,kd->hqk", q_rope, k_rope))
        elif mode == "absorbed":
            q_lat = torch.einsum("qhd,hdr->qhr", q_nope, w_uk)
            scores = torch.einsum("qhr,kr->hqk", q_lat, c) + torch.einsum("qhd,kd->hqk", q_rope, k_rope)
        else:
            raise OracleError(f"attention mode {mode!r} is not naive or absorbed")
        scores = (scores * self.softmax_scale).masked_fill(~causal.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if mode == "naive":
            out = torch.einsum("hqk,khd->qhd", probs, v)
        else:
            out = torch.einsum("hqr,hdr->qhd", torch.einsum("hqk,kr->hqr", probs, c), w_uv)
        return linear(out.reshape(x.shape[0], h * dv), self.o_proj), (c_new, k_rope_new)


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

    def __call__(self, x, positions, past=None, mode="naive"):
        attn_out, new_kv = self.attn(rms_norm(x, self.input_norm, self.eps), positions, past, mode)
        x = x + attn_out
        x = x + self.mlp(rms_norm(x, self.post_attention_norm, self.eps))
        return x, new_kv


class Cache:
    """The per-layer latent cache of one sequence: what the engine's paged MLA cache holds."""

    def __init__(self, num_layers):
        self.layers = [(torch.zeros(0), torch.zeros(0), []) for _ in range(num_layers)]
        self.length = 0

    def append(self, layer, c, k_rope, positions):
        old_c, old_k, old_pos = self.layers[layer]
        if old_pos:
            c, k_rope = torch.cat([old_c, c]), torch.cat([old_k, k_rope])
        self.layers[layer] = (c, k_rope, old_pos + list(positions))


class Mtp:
    """Multi-token-prediction module k, stored as model.layers.{num_hidden_layers + k}.*
    (vLLM deepseek_mtp.py): x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) with h_i the main model's
    hidden state before the final norm, one decoder layer over the positions, then
    shared_head.head(shared_head.norm(x)). vLLM also zeroes the embedding at position 0; the paper and
    SGLang do not, and neither does this reference unless asked (mask_position0)."""

    def __init__(self, cfg, ck, k, rope, main_embed, main_head):
        idx = cfg.num_hidden_layers + k
        prefix = f"model.layers.{idx}."
        hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.embed = (ck.get(prefix + "embed_tokens.weight", [cfg.vocab_size, hidden])
                      if ck.has(prefix + "embed_tokens.weight") else main_embed)
        self.enorm = ck.get(prefix + "enorm.weight", [hidden])
        self.hnorm = ck.get(prefix + "hnorm.weight", [hidden])
        self.eh_proj = ck.get(prefix + "eh_proj.weight", [hidden, 2 * hidden])
        self.layer = DecoderLayer(cfg, ck, idx, rope)
        self.head_norm = ck.get(prefix + "shared_head.norm.weight", [hidden])
        self.head = (ck.get(prefix + "shared_head.head.weight", [cfg.vocab_size, hidden])
                     if ck.has(prefix + "shared_head.head.weight") else main_head)

    def __call__(self, next_tokens, main_hidden, positions, mode="naive", mask_position0=False):
        e = self.embed[torch.tensor(next_tokens, dtype=torch.long)]
        if mask_position0:
            e = e.masked_fill(torch.tensor(list(positions)).unsqueeze(-1) == 0, 0.0)
        x = linear(torch.cat([rms_norm(e, self.enorm, self.eps), rms_norm(main_hidden, self.hnorm, self.eps)],
                             dim=-1), self.eh_proj)
        x, _ = self.layer(x, positions, None, mode)
        return linear(rms_norm(x, self.head_norm, self.eps), self.head)


class Model:
    def __init__(self, model_dir):
        self.cfg = cfg = Config(os.path.join(model_dir, "config.json"))
        self.ck = ck = Checkpoint(model_dir, cfg.weight_block_size)
        self.rope = Rope(cfg)
        hidden = cfg.hidden_size
        self.embed = ck.get("model.embed_tokens.weight", [cfg.vocab_size, hidden])
        self.layers = [DecoderLayer(cfg, ck, i, self.rope) for i in range(cfg.num_hidden_layers)]
        self.norm = ck.get("model.norm.weight", [hidden])
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
            if ck.has("lm_head.weight"):
                ck.used.add("lm_head.weight")  # ignored, as HF ties the output embedding to the input one
        else:
            self.lm_head = ck.get("lm_head.weight", [cfg.vocab_size, hidden])
        self._mtp = None
        self._check_unused()

    def _check_unused(self):
        """Every stored tensor must be one the architecture reads (MTP layers are loaded on demand),
        so a misnamed or extra tensor in a generated checkpoint is an error, not silently ignored."""
        mtp_prefixes = tuple(f"model.layers.{self.cfg.num_hidden_layers + k}."
                             for k in range(self.cfg.num_nextn_predict_layers))
        unused = sorted(n for n in self.ck.location if n not in self.ck.used
                        and not n.startswith(mtp_prefixes) and not n.endswith("rotary_emb.inv_freq"))
        if unused:
            more = f" (and {len(unused) - 10} more)" if len(unused) > 10 else ""
            raise OracleError(f"{self.ck.model_dir}: tensors not used by the {self.cfg.arch} architecture "
                              f"described by config.json: {', '.join(unused[:10])}{more}")

    @property
    def mtp(self):
        if self._mtp is None:
            if self.cfg.num_nextn_predict_layers < 1:
                raise OracleError(f"{self.cfg.path}: MTP requested but num_nextn_predict_layers is 0")
            self._mtp = Mtp(self.cfg, self.ck, 0, self.rope, self.embed, self.lm_head)
        return self._mtp

    def check_tokens(self, tokens):
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size:
                raise OracleError(f"request: token id {t!r} is not in [0, vocab_size {self.cfg.vocab_size})")

    def hidden(self, tokens, cache=None, mode="naive"):
        """Hidden states before the final norm for `tokens`, which follow the cache's tokens (if any)."""
        start = cache.length if cache is not None else 0
        positions = list(range(start, start + len(tokens)))
        x = self.embed[torch.tensor(tokens, dtype=torch.long)]
        for i, layer in enumerate(self.layers):
            past = cache.layers[i] if cache is not None else None
            x, (c, k_rope) = layer(x, positions, past, mode)
            if cache is not None:
                cache.append(i, c, k_rope, positions)
        if cache is not None:
            cache.length += len(tokens)
        return x

    def logits(self, hidden):
        return linear(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head)

    def mtp_logits(self, tokens, hidden, mode="naive", mask_position0=False):
        """MTP logits at positions 0..len-2: position i is fed token i+1 and the main hidden state h_i."""
        n = len(tokens) - 1
        if n <= 0:
            return torch.zeros(0, self.cfg.vocab_size)
        return self.mtp(tokens[1:], hidden[:n], list(range(n)), mode, mask_position0)


# ------------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------------

def greedy_argmax(row, masked):
    """Index of the largest logit outside `masked`; ties go to the lowest index."""
    values = row.numpy().copy()
    values[masked] = -np.inf
    return int(np.argmax(values))


def greedy_margin(row, masked):
    """(top logit - second logit) / largest |logit|, outside `masked`: how clear the greedy choice
    of this row is."""
    values = np.delete(row.numpy().astype(np.float64), masked)
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
    known = {"sequences", "all_logits", "greedy_tokens", "greedy_masked", "mtp", "attention",
             "mtp_mask_position0"}
    unknown = sorted(set(req) - known)
    if unknown:
        raise OracleError(f"request: unknown field(s) {unknown}")
    seqs = req.get("sequences")
    if not isinstance(seqs, list) or not all(isinstance(s, list) and s for s in seqs):
        raise OracleError("request: sequences must be a list of non-empty lists of token ids")
    for key in ("all_logits", "mtp", "mtp_mask_position0"):
        if key in req and not isinstance(req[key], bool):
            raise OracleError(f"request: {key} must be true or false")
    greedy = req.get("greedy_tokens", 0)
    if isinstance(greedy, bool) or not isinstance(greedy, int) or greedy < 0:
        raise OracleError("request: greedy_tokens must be a non-negative integer")
    masked = req.get("greedy_masked", [])
    if not isinstance(masked, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in masked):
        raise OracleError("request: greedy_masked must be a list of non-negative token ids")
    mode = req.get("attention", "naive")
    if mode not in ("naive", "absorbed"):
        raise OracleError(f"request: attention {mode!r} is not naive or absorbed")
    return (seqs, req.get("all_logits", False), greedy, masked, req.get("mtp", False), mode,
            req.get("mtp_mask_position0", False))


def run_request(model, req):
    seqs, all_logits, greedy_n, masked, want_mtp, mode, mask0 = parse_request(req)
    if any(i >= model.cfg.vocab_size for i in masked):
        raise OracleError(f"request: greedy_masked holds an id beyond the vocabulary of "
                          f"{model.cfg.vocab_size}")
    out = []
    for n, tokens in enumerate(seqs):
        model.check_tokens(tokens)
        hidden = model.hidden(tokens, mode=mode)
        rows = hidden if all_logits else hidden[-1:]
        entry = {"logits": finite_rows(model.logits(rows), f"sequence {n}: logits"), "greedy": [],
                 "greedy_margins": [], "mtp_logits": []}
        if greedy_n:
            ids = list(tokens)
            row = model.logits(hidden[-1:])[0]
            for step in range(greedy_n):
                nxt = greedy_argmax(row, masked)
                ids.append(nxt)
                entry["greedy"].append(nxt)
                entry["greedy_margins"].append(greedy_margin(row, masked))
                if step + 1 < greedy_n:  # full recomputation over the whole sequence so far
                    row = model.logits(model.hidden(ids, mode=mode)[-1:])[0]
        if want_mtp:
            entry["mtp_logits"] = finite_rows(model.mtp_logits(tokens, hidden, mode, mask0),
                                              f"sequence {n}: MTP logits")
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
                + json.dumps(seq["greedy"]) + ',"greedy_margins":' + json.dumps(seq["greedy_margins"])
                + ',"mtp_logits":' + matrix(seq["mtp_logits"]) + "}")
    f.write("]}\n")


def main(argv):
    if len(argv) != 4:
        sys.stderr.write("usage: deepseek_reference.py MODEL_DIR REQUEST.json OUT.json\n")
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
        sys.stderr.write(f"deepseek_reference: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
