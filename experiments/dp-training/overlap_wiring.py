"""Wiring check: does NxDStrategy arm the overlap under CausalLMModule (forward_backward) and automatic accumulation?"""
import sys, json, time
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from nxdt.lightning import NxDStrategy

class Probe(Callback):
    def __init__(self): self.seen = []
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        dp = trainer.strategy._dp
        self.seen.append([r.issued_in_backward for r in dp._reductions] + [len(r.buckets) for r in dp._reductions])

def causal(zero1):
    from nxdt.config import compose_config
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule
    cfg = compose_config(["data=synthetic", "data.global_batch_size=8", "data.micro_batch_size=2", "data.seq_length=64", "trainer.max_steps=3", "trainer.devices=2"])
    probe = Probe()
    st = NxDStrategy(zero1=zero1, bucket_cap_mb=0.5)
    tr = pl.Trainer(accelerator="cpu", devices=2, strategy=st, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe])
    m = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size)
    tr.fit(m, datamodule=NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True))
    st.close()
    return {"off": st.overlap_off, "seen": probe.seen}

class Auto(pl.LightningModule):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    def training_step(self, batch, i):
        x, y = batch; return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=4)

def auto(overlap):
    probe = Probe()
    st = NxDStrategy(bucket_cap_mb=0.01, overlap_grad_reduce=overlap)
    tr = pl.Trainer(accelerator="cpu", devices=2, strategy=st, max_epochs=1, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
    m = Auto(); tr.fit(m)
    st.close()
    return {"off": st.overlap_off, "seen": probe.seen, "w": [p.detach().reshape(-1).tolist() for p in m.parameters()]}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    res = {"causal": causal(False), "causal_zero1": causal(True), "auto_on": auto(True), "auto_off": auto(False)}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(__import__("os").environ.get("LOCAL_RANK", 0))
    (out / f"rank{rank}.json").write_text(json.dumps(res))
