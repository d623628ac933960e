"""Writes the bundled miniature train/test splits of the synthetic task suite.

  python scripts/make_tiny_data.py [--out_dir refusion_jax/assets/data]

The held-out split uses another seed and excludes every train query, so the
two never share a query. Re-running gives byte-identical files.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refusion_jax import tasks  # pylint: disable=wrong-import-position

TRAIN_SEED = 0
TEST_SEED = 1


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.path.dirname(tasks.TINY_TRAIN_FILE))
  parser.add_argument("--n_train", type=int, default=20000)
  parser.add_argument("--n_test", type=int, default=210)
  args = parser.parse_args(argv)
  train = tasks.generate(None, args.n_train, seed=TRAIN_SEED)
  test = tasks.generate(None, args.n_test, seed=TEST_SEED,
                        exclude=[e["query"] for e in train])
  tasks.write_jsonl(os.path.join(args.out_dir, "tiny_train.jsonl"), train)
  tasks.write_jsonl(os.path.join(args.out_dir, "tiny_test.jsonl"), test)
  print(f"wrote {len(train)} train and {len(test)} test examples to {args.out_dir}")


if __name__ == "__main__":
  main()
