"""The recipes of docs/integrations.md: HF Trainer and Accelerate checkpoint, resume with the same scales."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

import fp8pass  # noqa: E402
from fp8pass import checkpoint  # noqa: E402

CFG = fp8pass.Config(compiler="aot_eager")


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self):
        self.tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2))
    checkpoint.attach(model, CFG)  # the recipe: hooks before Trainer may load a checkpoint
    model.compile(backend=fp8pass.backend(CFG))
    return model


def _trainer(model, out, steps):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
        logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-2, seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=RandomTokens())


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_checkpoint_carries_the_scales_and_resume_continues_with_them(tmp_path):
    from safetensors.torch import load_file

    torch._dynamo.reset()
    warnings.simplefilter("ignore")
    model = _model()
    full = _trainer(model, tmp_path, 3)
    full.train()
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert sum(".fp8_scaling." in k for k in saved) == 2 * 7 * 12  # 7 FP8 linears per layer, 12 tensors each
    assert int(saved["model.layers.1.mlp.down_proj.weight.fp8_scaling.grad_output.steps"]) == 2

    resumed_model = _model()
    resumed = _trainer(resumed_model, tmp_path, 3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert _losses(resumed) == _losses(full)  # step 3 recomputed after the resume
    want, got = fp8pass.scaling_state_dict(model), fp8pass.scaling_state_dict(resumed_model)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_accelerate_save_state_and_load_state_continue_with_the_same_scales(tmp_path):
    import accelerate

    torch._dynamo.reset()
    batch = RandomTokens()[slice(0, 4)]

    def run(model, steps, load=None, save=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        acc = accelerate.Accelerator(cpu=True)
        model, opt = acc.prepare(model, opt)
        if load:
            acc.load_state(load)
        losses = []
        for step in range(steps):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if save and step == 1:
                acc.save_state(save)
        return losses

    torch.manual_seed(5)
    model = _model()
    full = run(model, 3, save=str(tmp_path / "state"))
    resumed_model = _model()
    assert run(resumed_model, 1, load=str(tmp_path / "state")) == full[2:]
    want, got = fp8pass.scaling_state_dict(model), fp8pass.scaling_state_dict(resumed_model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
