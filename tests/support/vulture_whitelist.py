"""Names vulture (tests/unit/test_dead_code.py) cannot see used, each with who uses it. Vulture matches by name only:
a line here keeps every definition of that name. Add a name only with its user; dead code is deleted instead."""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# found by name in a string the test cannot read as a reference
_.load_json  # tasks/*.yaml: custom_dataset: !function kv_utils.load_json
_.load_needle  # tasks/kv_needle.yaml: custom_dataset: !function kv_utils.load_needle
_.process_decode, _.process_turns  # kv_decode.yaml, kv_multiturn.yaml: process_results: !function kv_turns.NAME
_.bench, _.report  # cli/app.py: TOOLS (a command NAME is its module's function NAME)

# called by a framework
_._root  # typer: @app.callback()
_.__signature__, _.__annotations__  # cli/check_cmd.py: what typer reads of a generated command
_.reset_parameters  # torch.nn.Module's initialisation hook
_.tokenizer_name, _.loglikelihood_rolling, _.generate_until  # lm_eval's LM API (lm_eval_adapter.EngineLM)
_.__getattr__  # a module's lazy attributes (PEP 562)
_.__wrapped__  # inspect.unwrap: engines/vllm/faults/patching.py marks each patch with vLLM's original
_.html, _.junit  # enum members: values of --format
_.pre_tokenizer, _.decoder, _.post_processor, _.architectures  # set on tokenizers / transformers objects

# fields read through asdict / to_json / the object's users outside kvdiag
_.vs_copy, _.baselines  # bench/measure.py: Row, read as JSON
_.bos_token_id  # engines/builtin: config field and tokenizer attribute (Hugging Face's names)

# public API, documented (README.md, docs/DESIGN.md)
_.cases_frame, _.samples_frame  # kvdiag.results DataFrames
_.register  # checks/registry.py: a check registered from Python
_.set_kv_dtype  # engines/builtin/engine.py: another kv dtype on the loaded weights (tests/unit/test_builtin_engine.py)

# read by tests and scripts only: what an engine or a result exposes for inspection
_.captures, _.replays  # engines/builtin/cuda_graph.py counters (tests/unit/test_cuda_graphs.py)
_.ptr_table, _.stride_table  # the builtin engine's derived tables that the S2 fault leaves stale
_.used_slots  # bench/measure.py: PagedBatch (tests/unit/test_triton_kernels.py)
_.used_bytes  # engine_processes.py: GpuView (tests/integration/test_engine_processes.py)
_.mean_stderr  # checks/sweep/stats.py (tests/unit/test_stats.py, tests/integration/test_ci_run.py)
_.PAIR_TOKENS  # tasks/recall.py (scripts/train_tiny_model.py)
_.cuda_untouched  # engines/vllm/preimport.py: asserted by tests/gpu/test_vllm_gpu.py on a GPU
_.postfix, _.format_dict, _.refresh  # engines/vllm/progress.py's bar: read and called by vLLM's LLM._run_engine
_.__spec__  # run/runner.py: the caller's __main__ as multiprocessing reads it (spawn.get_preparation_data)
_.min_width  # render/fit.py: a rich Column's least width, read by rich's table layout
_.display_type_rich  # cli/app.py: click's parameter attribute that typer's rich help reads
_.schema_version  # results.RunRecord: a field of run.json, read by its users
_._all_tasks, _._all_subtasks, _._all_groups, _._all_tags  # lm_eval's TaskManager fields (kvdiag.tasks._merge_index)
_._instances  # lm_eval's Task field that apply_filters reads (proof/lm_eval_docs_script.py sets it)
_.WARMED  # engines/vllm/preimport.py: what the fork server warmed (tests/integration/test_vllm_model_info.py)
_.recipe  # zoo.Preset: scripts/train_tiny_model.py reads it (outside vulture's paths)
_.warm_from_llama  # zoo.Preset: scripts/train_tiny_model.py reads it
_.from_llama  # kvdiag.models.zoo_warm: scripts/train_tiny_model.py calls it
