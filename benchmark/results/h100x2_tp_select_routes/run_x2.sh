set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/device.txt
echo "commit 44f5454" >> $OUT/device.txt
mkdir -p $OUT/extras $OUT/softcap
timeout 200 torchrun --nproc_per_node=2 torchrun/run_invariant_tp2.py --extras --no-cost --out $OUT/extras > $OUT/inv_extras.log 2>&1; echo "extras rc=$?"
timeout 200 torchrun --nproc_per_node=2 torchrun/run_invariant_tp2.py --extras --no-cost --softcap 30 --out $OUT/softcap > $OUT/inv_softcap.log 2>&1; echo "softcap rc=$?"
grep -v -i warn $OUT/inv_extras.log | tail -12
grep -v -i warn $OUT/inv_softcap.log | tail -6
timeout 240 torchrun --nproc_per_node=2 torchrun/run_lce_tp2.py --bad-input > $OUT/run_lce_tp2.log 2>&1; echo "lce_tp2 rc=$?"
grep -v -i warn $OUT/run_lce_tp2.log | tail -4
