"""The systems the harness compares, each a module implementing `base.System`: gemps' settings
(gemps.py), PyTorch DDP under torchrun (ddp.py) and the peers' programs (peers.py, from
alternatives/peers/peers.json). `SYSTEMS` names them; DN+DyLU joins gemps' settings once the server
has its rule (gemps.SETTINGS)."""
