# %% [markdown]
# # 03 · Schedules: who runs what, when, and what it must keep
#
# A schedule is data: one action list per stage (`F3` = forward of micro-batch 3, `R` its
# recomputation, `B` its backward, and in the split-backward `-zb` schedules `W` the weight
# gradients, which fill idle time). The simulator replays it with per-stage costs; here the
# textbook unit costs F = R = 1, B = 2 on P = 4 stages and m = 8 micro-batches. Every schedule
# that `varuna_fx.schedule.schedule_names()` lists appears below.

# %%
import matplotlib.pyplot as plt

from varuna_fx.schedule import build_schedule, gantt, schedule_names, simulate, text_grid

P, M = 4, 8
runs = {}
for name in schedule_names():
    sched = build_schedule(name, num_stages=P, num_micro_batches=M, recompute=True)
    runs[name] = simulate(sched, forward=[1.0] * P, backward=[2.0] * P)
# deterministic
for name, r in runs.items():
    print(f"{name:9s} step {r.step_time:5.1f}  bubble {r.bubble_fraction:6.1%}  "
          f"peak stash per stage {r.peak_stash_count}")
print(text_grid(runs["varuna"]))

# %% [markdown]
# ## Gantt charts
#
# One row per stage, micro-batch numbers on the bars. GPipe runs all forwards, then all
# backwards; 1F1B alternates one forward and one backward after a warm-up; Varuna's order runs
# each recomputation just before its backward and fills idle slots with the forwards of later
# micro-batches; the `-zb` variants move each weight-gradient part `W` into idle time.

# %%
fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.2 * len(runs)), sharex=True,
                         layout="constrained")
for ax, (name, r) in zip(axes, runs.items()):
    gantt(r, ax=ax, title=f"{name}: step {r.step_time:g}, bubble {r.bubble_fraction:.0%}")
    ax.set_xlabel("")
axes[-1].set_xlabel("time (units: F = R = 1, B = 2)")
plt.show()

# %% [markdown]
# ## Stash memory
#
# With recomputation a stage keeps only each in-flight micro-batch's *input* until its
# backward. The peak count of such stashes is the schedule's memory bill: GPipe keeps all m on
# every stage, 1F1B P - s on stage s; Varuna's early forwards make its first stages hold more,
# which is cheap because a recomputing stage stashes only its input. A split backward keeps a
# micro-batch's activations until its `W` has run.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
width = 0.8 / len(runs)
for k, (name, r) in enumerate(runs.items()):
    left.bar([s + (k - (len(runs) - 1) / 2) * width for s in range(P)], r.peak_stash_count,
             width, label=name)
left.set_xticks(range(P), [f"stage {s}" for s in range(P)])
left.set_ylabel("peak stashed micro-batches")
left.set_title(f"P = {P}, m = {M}")
left.legend(frameon=False)
counts = [2, 4, 8, 16, 32]
for name in runs:
    bubbles = [simulate(build_schedule(name, P, m, True), [1.0] * P, [2.0] * P).bubble_fraction
               for m in counts]
    right.plot(counts, bubbles, marker="o", label=name)
right.set_xscale("log", base=2)
right.set_xlabel("micro-batches m")
right.set_ylabel("bubble (idle share)")
right.set_title("more micro-batches, smaller bubble")
right.legend(frameon=False)
plt.show()
