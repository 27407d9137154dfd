"""A sweep of kv dtypes against a baseline dtype: what accuracy and dtypes share. Every dtype's case runs the same
drift probe; the parent pairs each with the baseline's case and judges it.

Files: ``engine_use.py`` (the engine of a sweep's cases: per case, or shared in an ``--isolate run`` worker),
``drift.py`` (the teacher-forced drift probe and each dtype family's limits), ``drift_position.py`` (drift by
position bucket, and when it grows), ``storage_audit.py`` (what a cache stores, layer by layer), ``stats.py`` (the
paired tests), ``power.py`` (what a paired comparison could have seen), ``verdicts.py`` (a dtype's verdict from
them).
"""
