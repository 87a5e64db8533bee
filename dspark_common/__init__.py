# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What the installer, the launcher and the image's entrypoint share: the bounded YAML reader.

Standard library and PyYAML only, as each of its users must run with no more than that."""
