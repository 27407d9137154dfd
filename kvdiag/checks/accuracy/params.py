"""The accuracy check's options (each default written once: the CLI, the config and the worker read
them from here)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.checks.accuracy.drift_decoded import MAX_TOKENS
from kvdiag.checks.accuracy.harness.lm_eval_options import AUTO_BATCH
from kvdiag.checks.check import option
from kvdiag.checks.sweep.drift import drift_limit


@dataclass
class AccuracyParams:
    tasks: list[str] = option([], "--tasks", "-t", help="lm_eval task names or globs (comma-separated or repeated). "
                              "Default: kvdiag's shipped tasks (kv_recall, kv_recall_long); it also ships the harder "
                              "kv_recall_p128, kv_recall_p152, kv_recall_p176, kv_recall_p176_early (longer than the "
                              "tiny models were trained on: scores below 1, for zoo models), and kv_recall_p450_early, "
                              "kv_recall_p550_early (4-6k tokens: zoo:gemma3's, with -a max_model_len=8192), "
                              "kv_needle (a grid of context length x needle depth up to the engine's max_model_len, "
                              "scored per cell), and the generated conversations kv_decode (chains of 1-16 pairs) "
                              "and kv_multiturn (12 turns). Any lm_eval task works (indexing lm_eval's tasks adds "
                              "~7 s).")
    include_paths: list[str] = option([], "--include-path", help="A folder of your own lm_eval task YAML files; "
                                      "repeatable.")
    needle_lengths: list[int] = option([], "--needle-length", min=1, help="A context length (tokens) of "
                                       "kv_needle's grid; repeatable. Default: the engine's max_model_len and its "
                                       "halves, 5 lengths (-a max_model_len=N for a longer grid, up to the model's "
                                       "max_position_embeddings).")
    baseline: str = option("auto", "--baseline", help="The kv dtype every other dtype is compared with.")
    limit: float | None = option(None, "--limit", help="Documents per task (an int), or a fraction of each "
                                 "task when < 1 (as in lm_eval).")
    num_fewshot: int | None = option(None, "--num-fewshot", min=0, help="Few-shot examples (lm_eval).")
    seed: int = option(0, "--seed", help="Random seed for sampling and for lm_eval.")
    batch_size: str = option("auto", "--batch-size", "-b", help="Requests per engine call: an integer, or auto "
                             f"({AUTO_BATCH}: the engine schedules them).")
    apply_chat_template: str | None = option(None, "--apply-chat-template", help="Format prompts with the "
                                             "model's chat template, as lm_eval: alone, the tokenizer's template; "
                                             "--apply-chat-template NAME, that one of its templates.")
    fewshot_as_multiturn: bool | None = option(None, "--fewshot-as-multiturn/--no-fewshot-as-multiturn",
                                               help="Few-shot examples as a multi-turn conversation (default: on "
                                               "with --apply-chat-template, as lm_eval).")
    system_instruction: str | None = option(None, "--system-instruction", help="A system instruction before "
                                            "every prompt (lm_eval).")
    gen_kwargs: str | None = option(None, "--gen-kwargs", help="Generation arguments for every generating task, "
                                    "key=value,key=value or a JSON object (e.g. max_gen_toks=512,temperature=0); "
                                    "they update each task's own.")
    metadata: str | None = option(None, "--metadata", help="Task metadata, key=value,key=value or a JSON object "
                                  "(e.g. '{\"max_seq_lengths\": [4096]}' for RULER); kvdiag adds pretrained=MODEL "
                                  "and the --engine-arg values, as lm_eval merges model_args.")
    max_drop: float = option(0.02, "--max-drop", min=0, help="A drop (in the metric's units, e.g. 0.02 = 2 points "
                             "of acc) larger than this and significant at --alpha is a regression.")
    alpha: float = option(0.05, "--alpha", min=0, max=1, help="Significance level of the paired test.")
    strict: bool = option(False, "--strict", help="An inconclusive verdict fails (exit 1): a drop beyond --max-drop "
                          "that is not significant, or a run whose documents could not have detected --max-drop "
                          "(the smallest drop they detect with power 0.8 is shown per task). Default: it is a "
                          "warning, with the documents that would settle it.")
    max_kl: float | None = drift_limit("max_kl")
    min_top1: float | None = drift_limit("min_top1")
    drift_decoded: int = option(0, "--drift-decoded", min=0, max=MAX_TOKENS, help="Decoded drift: each dtype "
                                "decodes this many tokens greedily from every drift prompt, the baseline dtype "
                                "scores them teacher-forced, and the drift shows KL by position along each dtype's "
                                "own continuation and where it first leaves what the baseline would write (0: off; "
                                "e.g. 128).")
