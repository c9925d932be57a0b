import pytest
import torch

from vigil.errors import SpecError
from vigil.spec import parse_spec
from vigil_trainer.compile import should_compile

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_compiles_on_a_gpu_below_zero_3_only():
    assert should_compile("auto", GPU, 0) and should_compile("auto", GPU, 2)
    assert not should_compile("auto", GPU, 3)  # a graph break at every parameter gather
    assert not should_compile("auto", CPU, 0)


def test_true_and_false_are_kept():
    assert should_compile(True, CPU, 3) and should_compile(True, GPU, 0)
    assert not should_compile(False, GPU, 0)


def test_the_spec_field_takes_auto_true_false_and_names_itself_otherwise():
    assert parse_spec("name: x\n").train.compile == "auto"
    assert parse_spec("name: x\ntrain: {compile: true}\n").train.compile is True
    assert parse_spec("name: x\ntrain: {compile: false}\n").train.compile is False
    with pytest.raises(SpecError, match=r"train\.compile"):
        parse_spec("name: x\ntrain: {compile: sometimes}\n")
