"""Builds the tiny Hugging Face Qwen3 / Qwen2 / Dream / Llama fixture of tests/test_{model,hf,dream}.py.

Needs torch + transformers, which refusion_jax itself does not depend on, so it
runs in its own environment (no hub access needed):

  python3 -m venv /work/torchvenv
  /work/torchvenv/bin/pip install torch transformers safetensors numpy
  HF_HUB_OFFLINE=1 /work/torchvenv/bin/python scripts/make_hf_fixture.py

writes, under tests/fixtures/hf_tiny/:

  gqa/     4 query heads over 2 kv heads, separate lm head, RoPE theta 1e6
  tied/    tied input/output embeddings, 2 heads over 1 kv head, RoPE theta 1e4
  qwen2_gqa/, qwen2_tied/   the same two shapes as Qwen2ForCausalLM (Qwen2.5's layout:
           q/k/v biases, no q/k norm)
  llama_gqa/, llama31/   LlamaForCausalLM (Llama-3's layout), the second with Llama
           3.1's "llama3" RoPE scaling; golden.npz also holds `logits_perm_bf16`
           (the model run in bfloat16)
  llada/   a LLaDA-layout folder: a LlamaForCausalLM saved under LLaDA's tensor names with
           LLaDA's config.json; golden.npz holds `input_ids` (mask tokens among them)
           and `logits_bidir` (the Llama run with a full, non-causal mask)
           each with config.json + model.safetensors (float32) + golden.npz
           (`input_ids`, `positions_seq` / `logits_seq`: ordinary positions,
           `positions_perm` / `logits_perm`: randomly permuted position ids with
           attention still causal in input order, as ReFusion's training uses)
  dream/   a Dream-layout folder: a Qwen2ForCausalLM with random biases saved with
           Dream's config.json (`model_type` "Dream", `DreamModel`, `auto_map`,
           `mask_token_id`); golden.npz holds `input_ids` (mask tokens among them, as
           in decoding), `logits_bidir` (Qwen2 run with an all-ones 4D attention mask,
           checked non-causal) and `logits_shifted` (the same shifted by one: token i
           read from position i-1, position 0 its own); schedule.json holds the
           tokens per step of Dream's linear schedule computed by torch in float32
           as Dream's generation code does, for a few (masked, steps) pairs
  configs/ hand-written config.json variants for `config.from_hf_config`
           (transformers 4.x layout, 5.x layout, a ReFusion-8B-style one)

Every weight is random, norm scales included, so a mistake in any mapping shows
up in the logits.

`--check_roundtrip DIR` runs the other direction: DIR holds `<name>/` folders
written by our `refusion_jax.hf.save`; each is loaded with transformers'
Qwen3ForCausalLM and its logits are compared with the golden ones. With
`--our_python=/work/venv/bin/python` and no DIR argument, the folders are first
produced by running `hf.load` -> `hf.save` on the fixture in that interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(REPO, "tests", "fixtures", "hf_tiny")
SEQ_LEN = 12
BATCH = 2

# name -> Qwen3Config / Qwen2Config fields (small: a few hundred KB of float32 weights in
# all). The Qwen2 ones (Qwen2.5's layout: q/k/v biases, no q/k norm, head_dim = hidden /
# heads) get random biases like every other weight.
MODELS = {
    "gqa": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    "tied": dict(vocab_size=160, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=256,
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    "qwen2_gqa": dict(vocab_size=144, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      rms_norm_eps=1e-6, tie_word_embeddings=False,
                      max_position_embeddings=256, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    "qwen2_tied": dict(vocab_size=136, hidden_size=64, intermediate_size=80,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=256, use_sliding_window=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # Llama (Llama-3's layout: no biases, no q/k norm, untied head, rope theta 500000),
    # and Llama 3.1's "llama3" RoPE scaling with a small original context, so that the
    # scaled, interpolated and kept frequencies all occur at head_dim 16.
    "llama_gqa": dict(vocab_size=120, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=256, attention_bias=False, mlp_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
    "llama31": dict(vocab_size=112, hidden_size=64, intermediate_size=80,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    max_position_embeddings=256, attention_bias=False, mlp_bias=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}),
    # LLaDA (LLaDA-8B's block: Llama's, no GQA, untied head), run without a causal mask.
    "llada": dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=256,
                  attention_bias=False, mlp_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
    "dream": dict(vocab_size=152, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  max_position_embeddings=256, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
}
# name -> (family, seed); the seeds of the first two predate the Qwen2 models.
FAMILY = {"gqa": ("qwen3", 100), "tied": ("qwen3", 101), "qwen2_gqa": ("qwen2", 102),
          "qwen2_tied": ("qwen2", 103), "dream": ("dream", 104), "llama_gqa": ("llama", 105),
          "llama31": ("llama", 106), "llada": ("llama", 107)}
# What Dream's config.json adds to Qwen2's (Dream-v0's keys; the ids fit the tiny vocab).
DREAM_CONFIG = {"architectures": ["DreamModel"], "model_type": "Dream",
                "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                             "AutoModel": "modeling_dream.DreamModel"},
                "mask_token_id": 151, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
# (masked positions, steps) pairs of schedule.json.
SCHEDULES = ((8, 8), (8, 4), (8, 16), (16, 8), (64, 64), (256, 256), (512, 512), (512, 256),
             (512, 128), (512, 1024), (1024, 512), (128, 32))


_CLASSES = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "dream": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}


def model_class(name: str):
  return _CLASSES[FAMILY[name][0]][1]


def build_model(name: str, seed: int):
  torch.manual_seed(seed)
  family, _ = FAMILY[name]
  config_class = _CLASSES[family][0]
  cfg = config_class(**MODELS[name], dtype="float32")
  model = model_class(name)(cfg).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight"):
        # Away from 1 so that a dropped or misplaced norm changes the logits.
        p.copy_(1.0 + 0.5 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model


def logits_of(model, ids_bt: np.ndarray, positions_bt: np.ndarray) -> np.ndarray:
  ids = torch.from_numpy(ids_bt).long()
  pos = torch.from_numpy(positions_bt).long()
  # An explicit all-ones padding mask: without it transformers infers "packed
  # sequences" from non-increasing position ids and stops attention at each jump.
  ones = torch.ones_like(ids)
  with torch.no_grad():
    out = model(input_ids=ids, position_ids=pos, attention_mask=ones, use_cache=False).logits
    # Cross-check against an explicit 4D causal mask (input order), which no
    # heuristic can reinterpret.
    t = ids.shape[1]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
    causal = causal.expand(ids.shape[0], 1, t, t)
    out4d = model(input_ids=ids, position_ids=pos, attention_mask=causal, use_cache=False).logits
  diff = (out - out4d).abs().max().item()
  if diff > 1e-5:
    raise AssertionError(f"padding-mask and explicit causal-mask logits differ by {diff}")
  return out.numpy().astype(np.float32)


def bidirectional_logits(model, ids_bt: np.ndarray) -> np.ndarray:
  """Logits of a Qwen2 model with every token attending to every token (Dream's
  attention), checked to be non-causal and equal under two attention kernels."""
  ids = torch.from_numpy(ids_bt).long()
  b, t = ids.shape
  full = torch.ones(b, 1, t, t, dtype=torch.bool)
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=full, use_cache=False).logits
    # Bidirectional: the last token changes the first position's output.
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    first = model(input_ids=changed, attention_mask=full, use_cache=False).logits[:, 0]
    if (first - out[:, 0]).abs().max().item() < 1e-4:
      raise AssertionError("the 4D all-ones mask left attention causal")
    # The same under the eager kernel with an additive float mask of zeros.
    impl = model.config._attn_implementation  # pylint: disable=protected-access
    model.config._attn_implementation = "eager"  # pylint: disable=protected-access
    try:
      zeros = torch.zeros(b, 1, t, t, dtype=torch.float32)
      eager = model(input_ids=ids, attention_mask=zeros, use_cache=False).logits
    finally:
      model.config._attn_implementation = impl  # pylint: disable=protected-access
  diff = (out - eager).abs().max().item()
  if diff > 1e-5:
    raise AssertionError(f"bidirectional logits differ by {diff} between kernels")
  return out.numpy().astype(np.float32)


def dream_schedules() -> list[dict]:
  """Tokens per step of Dream's linear schedule as its generation code computes them
  (torch float32 timesteps, `int(m * (1 - s / t))`, all left at the last step)."""
  out = []
  for masked, steps in SCHEDULES:
    ts = torch.linspace(1, 1e-3, steps + 1)
    left, counts = masked, []
    for i in range(steps):
      n = left if i == steps - 1 else int(torch.tensor(float(left)) * (1 - ts[i + 1] / ts[i]))
      counts.append(n)
      left -= n
    out.append({"masked": masked, "steps": steps, "counts": counts})
  return out


def make_dream(out_dir: str) -> None:
  name = "dream"
  _, seed = FAMILY[name]
  model = build_model(name, seed=seed)
  folder = os.path.join(out_dir, name)
  os.makedirs(folder, exist_ok=True)
  model.save_pretrained(folder, safe_serialization=True)
  for extra in ("generation_config.json",):
    path = os.path.join(folder, extra)
    if os.path.exists(path):
      os.remove(path)
  with open(os.path.join(folder, "config.json")) as f:
    cfg = json.load(f)
  cfg.update(DREAM_CONFIG)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
  rng = np.random.default_rng(seed - 100)
  ids_bt = rng.integers(0, MODELS[name]["vocab_size"] - 1, size=(BATCH, SEQ_LEN)).astype(np.int32)
  ids_bt[:, SEQ_LEN // 2:] = np.where(rng.random((BATCH, SEQ_LEN - SEQ_LEN // 2)) < 0.6,
                                      DREAM_CONFIG["mask_token_id"], ids_bt[:, SEQ_LEN // 2:])
  bidir = bidirectional_logits(model, ids_bt)
  shifted = np.concatenate([bidir[:, :1], bidir[:, :-1]], axis=1)
  np.savez_compressed(os.path.join(folder, "golden.npz"), input_ids=ids_bt,
                      logits_bidir=bidir, logits_shifted=shifted)
  with open(os.path.join(folder, "schedule.json"), "w") as f:
    json.dump(dream_schedules(), f)
    f.write("\n")
  print(f"wrote {folder}: {sum(p.numel() for p in model.parameters())} params")


# transformers' Llama names -> LLaDA's (its OLMo-derived code; see
# shared/TABLE1-BASELINES.md section 1.2), and the config.json LLaDA-8B writes, for the
# tiny shapes; the ids fit the tiny vocabulary.
LLADA_NAMES = (("model.embed_tokens.", "model.transformer.wte."),
               ("model.norm.", "model.transformer.ln_f."),
               ("lm_head.", "model.transformer.ff_out."),
               ("model.layers.", "model.transformer.blocks."),
               (".self_attn.o_proj.", ".attn_out."), (".self_attn.", "."),
               (".input_layernorm.", ".attn_norm."),
               (".post_attention_layernorm.", ".ff_norm."),
               (".mlp.gate_proj.", ".ff_proj."), (".mlp.up_proj.", ".up_proj."),
               (".mlp.down_proj.", ".ff_out."))
LLADA_CONFIG = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada",
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                 "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 96,
    "mlp_ratio": 4, "activation_type": "silu", "block_type": "llama", "vocab_size": 128,
    "embedding_size": 128, "rope": True, "rope_theta": 500000.0, "rope_full_precision": True,
    "layer_norm_type": "rms", "rms_norm_eps": 1e-5, "layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "include_bias": False, "include_qkv_bias": False,
    "weight_tying": False, "scale_logits": False, "alibi": False,
    "attention_layer_norm": False, "input_emb_norm": False, "max_sequence_length": 256,
    "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0,
    "flash_attention": False, "mask_token_id": 126, "eos_token_id": 1, "pad_token_id": 1,
    "precision": "amp_bf16", "use_cache": False}


def llada_name(name: str) -> str:
  for theirs, ours in LLADA_NAMES:
    name = name.replace(theirs, ours)
  return name


def make_llada(out_dir: str) -> None:
  """A LLaDA-layout folder: a random LlamaForCausalLM (MHA) saved under LLaDA's tensor
  names with LLaDA's config.json; golden.npz holds `input_ids` (mask tokens among them)
  and `logits_bidir`, the Llama model run with a full (non-causal) mask."""
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  name = "llada"
  _, seed = FAMILY[name]
  model = build_model(name, seed=seed)
  folder = os.path.join(out_dir, name)
  os.makedirs(folder, exist_ok=True)
  tensors = {llada_name(k): v.contiguous() for k, v in model.state_dict().items()}
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(LLADA_CONFIG, f, indent=2)
    f.write("\n")
  rng = np.random.default_rng(seed - 100)
  ids_bt = rng.integers(0, MODELS[name]["vocab_size"] - 2, size=(BATCH, SEQ_LEN)).astype(np.int32)
  ids_bt[:, SEQ_LEN // 2:] = np.where(rng.random((BATCH, SEQ_LEN - SEQ_LEN // 2)) < 0.6,
                                      LLADA_CONFIG["mask_token_id"], ids_bt[:, SEQ_LEN // 2:])
  np.savez_compressed(os.path.join(folder, "golden.npz"), input_ids=ids_bt,
                      logits_bidir=bidirectional_logits(model, ids_bt))
  print(f"wrote {folder}: {sum(p.numel() for p in model.parameters())} params")


def golden_inputs(vocab: int, seed: int):
  rng = np.random.default_rng(seed)
  ids_bt = rng.integers(0, vocab, size=(BATCH, SEQ_LEN)).astype(np.int32)
  positions_seq = np.broadcast_to(np.arange(SEQ_LEN, dtype=np.int32), (BATCH, SEQ_LEN)).copy()
  # Distinct positions, in a random order per row, with gaps (as after slot shuffling).
  positions_perm = np.stack(
      [rng.permutation(rng.choice(3 * SEQ_LEN, SEQ_LEN, replace=False)) for _ in range(BATCH)]
  ).astype(np.int32)
  return ids_bt, positions_seq, positions_perm


# Hand-written config.json variants (no weights) for from_hf_config tests.
CONFIG_VARIANTS = {
    # transformers 4.x: top-level rope_theta, torch_dtype, list eos.
    "qwen3_4x.json": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": True,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": [151645, 151643],
        "transformers_version": "4.51.0",
    },
    # transformers 5.x: rope_parameters, dtype.
    "qwen3_5x.json": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": False, "attention_bias": False, "dtype": "float32",
        "eos_token_id": 151645, "pad_token_id": 151643, "transformers_version": "5.0.0",
    },
    # ReFusion release: Qwen3-8B with the vocabulary resized to 151671 rows and
    # the two added specials (<|beginoftext|> 151669, <|mask|> 151670).
    # Qwen2.5-7B (Dream's backbone): q/k/v biases, no q/k norm, sliding window off.
    "qwen2_5_7b.json": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
        "max_position_embeddings": 131072, "max_window_layers": 28, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "transformers_version": "4.43.1",
    },
    # Dream-v0-Instruct-7B's config.json keys (Qwen2.5-7B's shapes, model_type "Dream",
    # remote-code auto_map, mask_token_id 151666), written from its published card: the
    # checkpoint itself was never loaded here.
    "dream_v0_7b.json": {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                     "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "mask_token_id": 151666, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "Dream", "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "pad_token_id": 151643, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 152064,
    },
    # Llama-3-8B-Instruct's and Llama-3.1-8B-Instruct's config.json keys (from their
    # published cards; the checkpoints were never loaded here).
    "llama3_8b_instruct.json": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128009,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "llama31_8b_instruct.json": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 128256,
    },
    # LLaDA-8B-Instruct's config.json keys (shared/TABLE1-BASELINES.md section 1.1).
    "llada_8b_instruct.json": {
        "architectures": ["LLaDAModelLM"], "activation_type": "silu", "alibi": False,
        "alibi_bias_max": 8.0, "attention_dropout": 0.0, "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": 4096, "embedding_dropout": 0.0, "embedding_size": 126464,
        "eos_token_id": 126081, "flash_attention": False, "include_bias": False,
        "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
        "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4,
        "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
        "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 126464,
        "weight_tying": False,
    },
    "refusion.json": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151671,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 151669,
        "eos_token_id": 151645, "pad_token_id": 151643, "mask_token_id": 151670,
    },
}


def make_fixture(out_dir: str, only=None) -> None:
  for name in sorted(MODELS):
    if only and name not in only:
      continue
    if name in ("dream", "llada"):
      (make_dream if name == "dream" else make_llada)(out_dir)
      continue
    family, seed = FAMILY[name]
    model = build_model(name, seed=seed)
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for extra in ("generation_config.json",):
      path = os.path.join(folder, extra)
      if os.path.exists(path):
        os.remove(path)
    ids_bt, positions_seq, positions_perm = golden_inputs(MODELS[name]["vocab_size"],
                                                         seed - 100)
    logits_seq = logits_of(model, ids_bt, positions_seq)
    # Sanity: explicit sequential position ids == transformers' default ones.
    with torch.no_grad():
      default = model(input_ids=torch.from_numpy(ids_bt).long()).logits.numpy()
    assert np.abs(default - logits_seq).max() < 1e-5
    logits_perm = logits_of(model, ids_bt, positions_perm)
    extra = {}
    if family == "llama":
      # The same model in bfloat16 (weights and activations), as Llama-3 ships.
      with torch.no_grad():
        bf16 = model.to(torch.bfloat16)
        extra["logits_perm_bf16"] = bf16(
            input_ids=torch.from_numpy(ids_bt).long(),
            position_ids=torch.from_numpy(positions_perm).long(),
            attention_mask=torch.ones(ids_bt.shape, dtype=torch.long),
            use_cache=False).logits.float().numpy()
    np.savez_compressed(
        os.path.join(folder, "golden.npz"), input_ids=ids_bt, positions_seq=positions_seq,
        logits_seq=logits_seq, positions_perm=positions_perm, logits_perm=logits_perm, **extra)
    print(f"wrote {folder}: {sum(p.numel() for p in model.parameters())} params")
  configs = os.path.join(out_dir, "configs")
  os.makedirs(configs, exist_ok=True)
  for fname, cfg in CONFIG_VARIANTS.items():
    with open(os.path.join(configs, fname), "w") as f:
      json.dump(cfg, f, indent=2)
      f.write("\n")


_OUR_ROUNDTRIP = """
import sys
from refusion_jax import hf
src, dst = sys.argv[1], sys.argv[2]
config, model = hf.load(src, dtype="float32")  # the fixtures are float32
hf.save(config, model, dst)
"""


def check_roundtrip(root: str) -> float:
  worst = 0.0
  for name in sorted(MODELS):
    folder = os.path.join(root, name)
    if not os.path.isdir(folder):
      raise FileNotFoundError(f"--check_roundtrip: no folder {folder}")
    golden = np.load(os.path.join(FIXTURE_DIR, name, "golden.npz"))
    if name == "llada":  # under LLaDA's names: renamed back, run as a bidirectional Llama
      from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
      back = {v: k for k, v in ((n, llada_name(n)) for n in
                                build_model(name, FAMILY[name][1]).state_dict())}
      state = {back[k]: v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
      model = transformers.LlamaForCausalLM(
          transformers.LlamaConfig(**MODELS[name], dtype="float32")).eval()
      model.load_state_dict(state)
      logits = bidirectional_logits(model, golden["input_ids"])
      delta = float(np.abs(logits - golden["logits_bidir"]).max())
      worst = max(worst, delta)
      print(f"{name} bidirectional: transformers on our export, max |delta| = {delta:.3e}")
      continue
    if name == "dream":  # Dream's layout is Qwen2's: run it as one, both ways
      with open(os.path.join(folder, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items()
               if k not in ("model_type", "architectures", "auto_map")}
      model = transformers.Qwen2ForCausalLM.from_pretrained(
          folder, config=transformers.Qwen2Config(**cfg), dtype=torch.float32).eval()
      logits = bidirectional_logits(model, golden["input_ids"])
      delta = float(np.abs(logits - golden["logits_bidir"]).max())
      worst = max(worst, delta)
      print(f"{name} bidirectional: transformers on our export, max |delta| = {delta:.3e}")
      continue
    model = model_class(name).from_pretrained(folder, dtype=torch.float32).eval()
    for kind in ("seq", "perm"):
      logits = logits_of(model, golden["input_ids"], golden[f"positions_{kind}"])
      delta = float(np.abs(logits - golden[f"logits_{kind}"]).max())
      worst = max(worst, delta)
      print(f"{name} {kind}: transformers on our export, max |delta| = {delta:.3e}")
  return worst


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=FIXTURE_DIR, help="where to write the fixture")
  parser.add_argument("--check_roundtrip", nargs="?", const="", default=None, metavar="DIR",
                      help="compare transformers' logits on our exported folders with golden")
  parser.add_argument("--our_python", default=None,
                      help="interpreter with refusion_jax installed, to export the fixture "
                      "with hf.load -> hf.save first (when --check_roundtrip has no DIR)")
  parser.add_argument("--tolerance", type=float, default=1e-4)
  parser.add_argument("--only", default="", help="comma-separated model names to (re)write "
                      "(default: every model; the configs are always written)")
  args = parser.parse_args()
  if args.check_roundtrip is None:
    make_fixture(args.out_dir, [n for n in args.only.split(",") if n] or None)
    return
  root = args.check_roundtrip
  with tempfile.TemporaryDirectory() as tmp:
    if not root:
      if not args.our_python:
        parser.error("--check_roundtrip without DIR needs --our_python")
      root = tmp
      for name in sorted(MODELS):
        subprocess.run([args.our_python, "-c", _OUR_ROUNDTRIP, os.path.join(FIXTURE_DIR, name),
                        os.path.join(root, name)], check=True, cwd=REPO,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    worst = check_roundtrip(root)
  print(f"worst max |delta| = {worst:.3e} (tolerance {args.tolerance})")
  if worst > args.tolerance:
    sys.exit(1)


if __name__ == "__main__":
  main()
