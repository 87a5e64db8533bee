# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Transactional, version-pinned installer of the DSpark overlay and patches into a vLLM tree.

Pure standard library plus pyyaml and packaging: it never imports vLLM or torch, so it works on
any interpreter that can read the target tree.
"""
