# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Copied from github.com/google/flax, examples/nnx_toy_examples/07_array_leaves.py, at
# commit 03e0b97b398c09d7236abe4f6e9c34028199d4a7: the data, `Linear`, `MLP`, `is_param`
# and `train_step` unmodified. Trimmed: the training loop, the plot (matplotlib) and the
# module-level model and optimizer. Used by jmp_policy's tests only.

# %%
import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

X = np.linspace(0, 1, 100)[:, None]
Y = 0.8 * X**2 + 0.1 + np.random.normal(0, 0.1, size=X.shape)


class Linear(nnx.Module):
  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.w = jax.random.normal(rngs.params(), (din, dout))
    self.b = jnp.zeros((dout,))

  def __call__(self, x):
    return x @ self.w + self.b


class MLP(nnx.Module):
  def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
    self.count = jnp.array(0)
    self.linear1 = Linear(din, dhidden, rngs=rngs)
    self.linear2 = Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    self.count += 1
    return self.linear2(nnx.relu(self.linear1(x)))

def is_param(path, value):
  key = path[-1]
  return key == 'w' or key == 'b'


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, batch):
  x, y = batch

  def loss_fn(model: MLP):
    y_pred = model(x)
    return jnp.mean((y - y_pred) ** 2)

  diff_state = nnx.DiffState(0, is_param)
  grads: nnx.State = nnx.grad(loss_fn, argnums=diff_state)(model)
  optimizer.update(model, grads)
