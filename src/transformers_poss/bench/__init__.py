"""`poss bench`: acceptance and speed of decoding methods measured side by side on one target.

- `run`: prompts (`load_questions`; `bundled_questions`: the MT-Bench file shipped in ``data/``), the interleaved
  run of every method on every prompt, the report (`build_report`, `finish`);
- `methods`: baseline, prompt lookup, assistants and PosS drafts as `Method`s; `metrics`: per-prompt records and
  summaries; `runtime`: environment, peak memory, synchronisation; `plots`; `batched`: ``--batch-size`` runs.

The command-line front end is `transformers_poss.cli.bench`.
"""

from .methods import (GenerationSettings, Method, MethodResult, Prompt, assistant_method, baseline_method,
                      draft_method, prompt_lookup_method)
from .run import (build_report, bundled_questions, encode_prompt, finish, load_questions, make_prompts,
                  mismatch_report, render, run_methods, timed_run)

__all__ = ["GenerationSettings", "Method", "MethodResult", "Prompt", "assistant_method", "baseline_method",
           "build_report", "bundled_questions", "draft_method", "encode_prompt", "finish", "load_questions",
           "make_prompts", "mismatch_report", "prompt_lookup_method", "render", "run_methods", "timed_run"]
