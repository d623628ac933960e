"""Query/response data: a TFDS builder for the release's JSON format and a grain loader.

Input files hold ReFusion's training format, `{"query": str, "response": str}`
per example, either as one JSON list (`[{...}, {...}]`) or as JSON lines.
Other fields are ignored.

  builder = prepare(["train.jsonl"], data_dir)      # validates, then builds once
  source = source_of(builder, "train")              # random access, no TensorFlow
  loader = make_loader(source, tokenizer, seq_len=256, batch_size=32, seed=0,
                       packing="first_fit")
  it = iter(loader)
  batch = next(it)   # {"tokens", "segment_ids", "positions", "segment_prompt_len",
                     #  "segment_response_len"}: int32 [b, seq_len] each

Each sample is `encode_prompt(query) + encode(response) + [eos]`. With
`packing="none"` every row holds one sample, right-padded with `pad_id`;
with "first_fit" / "best_fit" (grain's `FirstFitPackIterDataset` /
`BestFitPackIterDataset`) samples share rows, each whole and in its own
segment, padding after the last. Either way a batch is in the packed format
that `objective.loss_fn` reads (`objective.PACKED_KEYS`).

Checkpointing the data position: `it.get_state()` / `it.set_state(state)` on
the `BatchIterator`; resuming continues with exactly the batch that would have
come next, and a position saved for other data or settings is refused. For
orbax, grain 0.2.18 ships the handler `grain.checkpoint.CheckpointHandler`
with the args classes `grain.checkpoint.CheckpointSave` / `CheckpointRestore`;
this module exposes them as `ITERATOR_HANDLER`, `IteratorSave` and
`IteratorRestore`:

  manager = ocp.CheckpointManager(dir, item_handlers={
      "params": ocp.StandardCheckpointHandler(),
      "data": data.ITERATOR_HANDLER()})
  manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), data=data.IteratorSave(it)))
  manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract), data=data.IteratorRestore(it)))

The handler writes one `process_<i>-of-<n>.json` per JAX process (the
indices come from `jax.process_index()` / `jax.process_count()`), so every
host saves and restores its own shard's position.
"""

from refusion_jax.data.build import (
                                     QueryResponse,
                                     QueryResponseConfig,
                                     prepare,
                                     remove_incomplete_builds,
)
from refusion_jax.data.files import FIELDS, files_digest, iter_examples, validate_files
from refusion_jax.data.layout import (
                                     Layout,
                                     check_lengths,
                                     count_overlong,
                                     layout_of,
                                     measure_layout,
                                     pack_lengths,
                                     sample_lengths,
)
from refusion_jax.data.loader import (
                                     DEFAULT_PACKING_BINS,
                                     ITERATOR_HANDLER,
                                     PACKINGS,
                                     BatchIterator,
                                     DropCounter,
                                     IdentifiedSource,
                                     IteratorRestore,
                                     IteratorSave,
                                     Loader,
                                     check_packing,
                                     loader_from_config,
                                     make_loader,
                                     packing_bins_for,
                                     source_of,
                                     split_source,
)

__all__ = [
    "BatchIterator",
    "DEFAULT_PACKING_BINS",
    "DropCounter",
    "FIELDS",
    "ITERATOR_HANDLER",
    "IdentifiedSource",
    "IteratorRestore",
    "IteratorSave",
    "Layout",
    "Loader",
    "PACKINGS",
    "QueryResponse",
    "QueryResponseConfig",
    "check_lengths",
    "check_packing",
    "count_overlong",
    "files_digest",
    "iter_examples",
    "layout_of",
    "loader_from_config",
    "make_loader",
    "measure_layout",
    "pack_lengths",
    "packing_bins_for",
    "prepare",
    "remove_incomplete_builds",
    "sample_lengths",
    "source_of",
    "split_source",
    "validate_files",
]
