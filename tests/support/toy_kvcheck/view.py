def render(run, con):
    for c in run.cases:
        con.print(f"TOY TABLE {c.kv_dtype}: {c.metrics.get('rounds')} rounds, {c.metrics.get('mood')}")
