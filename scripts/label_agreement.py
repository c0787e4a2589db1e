"""How often the target's own next-token choice (top-1 of the soft labels) is the response's
next token, in `train features` dirs: ~1 for the target's regenerated answers, less for
answers someone else wrote (`train written`).

    .venv/bin/python scripts/label_agreement.py DIR [DIR ...] [--max-seqs 600]
"""

from __future__ import annotations

import argparse

from presto_sd.app.training.gen_data import load_shards


def agreement(data_dir: str, max_seqs: int) -> tuple[float, int]:
    agree = positions = 0
    for s in load_shards(data_dir)[:max_seqs]:
        top1 = s.soft_labels[0][:, 0].long()  # row t: the target's choice for token t + 1
        response = s.tokens[s.prompt_len :]
        agree += int((top1[s.prompt_len - 1 : len(s.tokens) - 1] == response).sum())
        positions += len(response)
    return agree / max(positions, 1), positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--max-seqs", type=int, default=600, help="the first N sequences of each dir")
    args = p.parse_args()
    for d in args.dirs:
        share, n = agreement(d, args.max_seqs)
        print(f"{d}: the target's top-1 is the response token at {share:.3f} of {n} response positions")


if __name__ == "__main__":
    main()
