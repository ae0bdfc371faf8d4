# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Morphing: useful work under preemption
#
# Varuna trains on preemptible machines. When one vanishes the job stops, restarts on the
# machines it has ("morphs": `vf.compile` re-plans for the new world, `pipe.load_checkpoint`
# re-shards the newest checkpoint) and continues with the same global batch. What is lost at
# each preemption:
#
# - **Varuna's policy**: everything trained since the last *periodic* checkpoint, plus the morph.
# - **Save on signal** (`pipe.preempted`: SIGTERM/SIGUSR1 sets it on every rank after the same
#   step, the loop saves within the grace period): only the save and the morph.
#
# `varuna_fx.launch.morphing` replays a preemption trace against both. The costs below are measured by
# `bench/bench_morph.py` for a 100M-parameter GPT on CPU (see bench/RESULTS.md); change them to
# your own.

# %%
import matplotlib.pyplot as plt

from varuna_fx.launch.morphing import (
    expected_fraction_on_signal,
    expected_fraction_periodic,
    preemption_trace,
    simulate_preemptions,
    young_daly_interval,
)

MORPH_S = 9.8  # signal -> first step on the new layout (bench_morph.py, median of 8 runs)
SAVE_S = 1.6  # blocking checkpoint save of model + AdamW state (1.2 GB over 2 ranks)
print(f"morph {MORPH_S} s, checkpoint {SAVE_S} s")

# %% [markdown]
# ## A preemption trace
#
# Preemptions arrive as a Poisson process: one per 10 minutes on average here. Both policies
# see the same trace over two hours. The periodic policy checkpoints every 5 minutes; the
# save-on-signal policy never checkpoints periodically. A flat stretch is a morph; a drop is
# work thrown away.

# %%
HOUR = 3600.0
trace = preemption_trace(600.0, 2 * HOUR, seed=3)
periodic = simulate_preemptions(trace, 2 * HOUR, interval_s=300.0, save_s=SAVE_S, morph_s=MORPH_S,
                    record=True)
on_signal = simulate_preemptions(trace, 2 * HOUR, interval_s=None, save_s=SAVE_S, morph_s=MORPH_S,
                     policy="on_signal", record=True)

fig, ax = plt.subplots(figsize=(9, 4))
for res, label in ((periodic, "periodic checkpoints (5 min)"), (on_signal, "save on signal")):
    t = [p[0] / 60 for p in res.timeline]
    w = [p[1] / 60 for p in res.timeline]
    ax.plot(t, w, label=f"{label}: {res.fraction:.1%} useful")
for p in trace:
    ax.axvline(p / 60, color="grey", lw=0.6, ls=":")
ax.plot([0, 120], [0, 120], color="black", lw=0.5, label="no preemptions")
ax.set_xlabel("wall time (min)")
ax.set_ylabel("training kept (min)")
ax.set_title(f"{len(trace)} preemptions in two hours (dotted)")
ax.legend()
plt.show()
print(f"periodic: lost {periodic.lost_s / 60:.1f} min of training, "
      f"morphing {periodic.morph_s / 60:.1f} min, checkpoints {periodic.checkpoint_s / 60:.1f} min")
print(f"on signal: lost {on_signal.lost_s / 60:.1f} min, morphing {on_signal.morph_s / 60:.1f} "
      f"min, checkpoints {on_signal.checkpoint_s / 60:.1f} min")

# %% [markdown]
# ## Useful work against the checkpoint interval
#
# Short intervals pay for many checkpoints; long ones lose much work per preemption. The
# optimum is near Young's interval $\sqrt{2\,C\,\mathrm{MTBF}}$. Lines are the closed form for
# Poisson preemptions (Daly 2006), dots the simulator on a long trace. Save-on-signal needs no
# periodic checkpoint at all (dashed: its fraction without any).

# %%
intervals = [10.0 * 1.25 ** k for k in range(25)]
fig, ax = plt.subplots(figsize=(9, 4))
for mean, color in ((600.0, "tab:red"), (3600.0, "tab:blue")):
    horizon = mean * 300
    tr = preemption_trace(mean, horizon, seed=0)
    exp = [expected_fraction_periodic(mean, i, SAVE_S, MORPH_S) for i in intervals]
    sim = [simulate_preemptions(tr, horizon, interval_s=i, save_s=SAVE_S, morph_s=MORPH_S).fraction
           for i in intervals]
    sig = expected_fraction_on_signal(mean, None, SAVE_S, MORPH_S)
    ax.plot(intervals, exp, color=color, label=f"periodic, one per {mean / 60:.0f} min")
    ax.plot(intervals, sim, "o", color=color, ms=3)
    ax.axhline(sig, color=color, ls="--", label=f"save on signal, one per {mean / 60:.0f} min")
    ax.axvline(young_daly_interval(mean, SAVE_S), color=color, lw=0.5)
    best = max(intervals, key=lambda i: expected_fraction_periodic(mean, i, SAVE_S, MORPH_S))
    print(f"one preemption per {mean / 60:.0f} min: best periodic interval ~{best:.0f} s -> "
          f"{expected_fraction_periodic(mean, best, SAVE_S, MORPH_S):.1%}; "
          f"save on signal {sig:.1%}")
ax.set_xscale("log")
ax.set_xlabel("checkpoint interval (s)")
ax.set_ylabel("useful-work fraction")
ax.set_ylim(0.5, 1.0)
ax.legend(loc="lower center")
plt.show()

# %% [markdown]
# ## How much the morph time matters
#
# At one preemption per 10 minutes, every second of morphing costs about 1/600 of the job.
# Varuna's paper models its restart at 76-701 s; Oobleck reconfigures in 2-10 s.

# %%
morphs = [1, 2, 5, 10, 20, 50, 100, 200, 400, 700]
fig, ax = plt.subplots(figsize=(9, 3.5))
for mean, color in ((600.0, "tab:red"), (3600.0, "tab:blue")):
    periodic_best = [max(expected_fraction_periodic(mean, i, SAVE_S, m) for i in intervals)
                     for m in morphs]
    signal = [expected_fraction_on_signal(mean, None, SAVE_S, m) for m in morphs]
    ax.plot(morphs, periodic_best, color=color, label=f"periodic (best), 1 per {mean / 60:.0f} min")
    ax.plot(morphs, signal, color=color, ls="--", label=f"on signal, 1 per {mean / 60:.0f} min")
ax.axvline(MORPH_S, color="black", lw=0.5)
ax.set_xscale("log")
ax.set_xlabel("morph time (s)")
ax.set_ylabel("useful-work fraction")
ax.legend(fontsize=8)
plt.show()
