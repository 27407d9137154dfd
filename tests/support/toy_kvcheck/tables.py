def tables(run):
    rows = [[c.kv_dtype, str(c.metrics.get("rounds")), str(c.metrics.get("mood"))] for c in run.cases
            if c.check == "toy"]
    return [("toy: rounds per kv dtype", ("kv dtype", "rounds", "mood"), rows)] if rows else []
