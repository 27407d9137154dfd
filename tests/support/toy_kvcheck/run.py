def run(case, ctx):
    p = case.params
    rec = case.result("pass", metrics={"rounds": p["rounds"], "mood": p["mood"]})
    if p["rounds"] > 3:
        rec.status = "fail"
        rec.add("error", "too_many", f"{p['rounds']} rounds: the toy counts to 3")
    return rec
