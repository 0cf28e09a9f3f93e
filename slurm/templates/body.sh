# This task by its array name (JOB_TASK): the task that started last has the array's own job id as
# SLURM_JOB_ID, and that id, signalled or requeued, is every task of the array.
me="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
me="${me:-$SLURM_JOB_ID}"
echo "layertap: Slurm job ${me} on $(hostname), restart ${SLURM_RESTART_COUNT:-0}: ${shown[*]}"

# Slurm sends SIGTERM to every process of the job (scancel, preemption, the time limit, a
# requeue), so the workers get it themselves and clean up: this shell only waits for them,
# up to KillWait. The early warning, USR1 from --signal=B:USR1@{{grace}}, reaches this shell
# alone: it is passed on to the workers as SIGTERM through Slurm, to the job's steps (a SIGTERM
# to srun itself would make it SIGKILL its step at once, with no time to clean up).
warned=0
child=
trap 'warned=1; scancel --signal=TERM "$me" 2>/dev/null || kill -TERM "$child" 2>/dev/null' USR1
trap ':' TERM INT USR2  # USR2: a stack dump asked with --full or --batch, which must not end the job
"${cmd[@]}" &
child=$!
rc=0
while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
wait "$child" 2>/dev/null; last=$?; [ "$last" -ne 127 ] && rc=$last
echo "layertap: exit ${rc}"
{{on_timeout}}exit "$rc"
