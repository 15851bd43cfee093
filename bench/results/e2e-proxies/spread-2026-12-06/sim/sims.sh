#!/bin/bash
# usage: spread-sims.sh SIDE DIR  -- the brief's sim checks, from source, into /work/wt/logs/spread-sim/SIDE
SIDE=$1; D=$2; O=/work/wt/logs/spread-sim/$SIDE; mkdir -p $O
S=/work/shared/data/sharegpt_v3_partial_turn_lengths.jsonl; T=/work/shared/data/mooncake_conversation_trace.jsonl
cd $D; K="env PYTHONPATH=$D /work/main/.venv/bin/python -m kvroute.cli"
echo "$SIDE start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> /work/wt/logs/spread-sim/runs.log
for seed in 1 2 3; do
  $K bench sim --no-plots --seed $seed --policy kv_cost --policy round_robin --data $S \
    --trace $T --scenario shared_prefix --scenario shared_prefix_4_routers \
    --scenario shared_prefix_100ms_load --scenario shared_prefix_llmd --scenario multi_turn \
    --scenario rag --scenario slow_replica --scenario no_reuse --scenario one_system_prompt \
    --out $O/s$seed > $O/s$seed.log 2>&1
  $K bench sim --no-plots --seed $seed --policy kv_cost --policy round_robin \
    --trace $T --requests 4000 --scenario mooncake --scenario mooncake_100ms_load --out $O/m$seed > $O/m$seed.log 2>&1
  $K bench sim --no-plots --seed $seed --scenario shared_prefix_4_routers \
    --policy kv_cost --policy llm-d:precise --data $S --out $O/sp4-s$seed > $O/sp4-s$seed.log 2>&1
  $K bench sim --no-plots --seed $seed --routers 4 --scenario rag \
    --policy kv_cost --policy llm-d:precise --data $S --out $O/rag-r4-s$seed > $O/rag-r4-s$seed.log 2>&1
  $K bench sim --no-plots --seed $seed --routers 8 --policy kv_cost --data $S \
    --scenario e2e_shared_prefix --scenario multi_turn --out $O/r8-s$seed > $O/r8-s$seed.log 2>&1
  echo "$SIDE seed $seed done $(date -u +%T)" >> /work/wt/logs/spread-sim/runs.log
done
