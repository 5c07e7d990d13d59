# Sourced by the sweep scripts (tools/train_sweep.sh, grpo_sweep.sh, thinking_sweep.sh): a run is a seed `N`, or `Np`
# for seed N with config.init_perturb=1e-6 (a start as another CPU's float rounding would make it).
#   run_spec SCRIPT RUN   sets seed=N and perturb=() or perturb=(--config.init_perturb=1e-6); on a bad RUN it names
#                         SCRIPT and RUN on stderr and returns 2.
run_spec() {
  if [[ ! $2 =~ ^([0-9]+)(p?)$ ]]; then echo "$1: run '$2' is not a seed N or Np" >&2; return 2; fi
  seed=${BASH_REMATCH[1]}
  perturb=()
  if [ -n "${BASH_REMATCH[2]}" ]; then perturb=(--config.init_perturb=1e-6); fi
}
