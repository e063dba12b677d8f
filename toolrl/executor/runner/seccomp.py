"""A seccomp filter for model-written code: the kernel calls a sandboxed snippet has no use for.

Installed by each runner after it drops to its lane's uid, just before the code runs (no_new_privs
comes from the zygote, so no privilege is needed). It refuses with EPERM what would let the code
build a sandbox of its own or reach into the kernel's riskier corners: new namespaces (unshare,
setns, clone with a CLONE_NEW* flag: an unprivileged user namespace would give it mount and network
powers of its own), mounts of any kind, chroot, ptrace and cross-process memory access, keyrings,
BPF, perf events, userfaultfd, io_uring and module or kexec loading, and sockets of any family but
Unix, IP and netlink (AF_VSOCK reaches the hypervisor past every network namespace; AF_ALG and the
rest are kernel surface no snippet needs: EAFNOSUPPORT). clone3 gets ENOSYS, so the C
library falls back to clone, whose flags the filter can read. Everything else is allowed: Python,
numpy, threads, fork and subprocesses work as before. x86_64 only (the numbers below are its own);
elsewhere the layer is reported missing.
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct

from toolrl.executor.syscalls import prctl

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
CLONE_NEW_FLAGS = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
NR_CLONE = 56
NR_SOCKET, NR_SOCKETPAIR = 41, 53
SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (glibc's getaddrinfo asks it)
DENIED = {  # x86_64 syscall number: errno
    272: errno.EPERM, 308: errno.EPERM,  # unshare, setns
    165: errno.EPERM, 166: errno.EPERM, 155: errno.EPERM, 161: errno.EPERM,  # mount, umount2, pivot_root, chroot
    428: errno.EPERM, 429: errno.EPERM, 430: errno.EPERM, 431: errno.EPERM,  # open_tree, move_mount, fsopen, fsconfig
    432: errno.EPERM, 433: errno.EPERM, 442: errno.EPERM,  # fsmount, fspick, mount_setattr
    101: errno.EPERM, 310: errno.EPERM, 311: errno.EPERM,  # ptrace, process_vm_readv/writev
    248: errno.EPERM, 249: errno.EPERM, 250: errno.EPERM,  # add_key, request_key, keyctl
    321: errno.EPERM, 298: errno.EPERM, 323: errno.EPERM,  # bpf, perf_event_open, userfaultfd
    425: errno.EPERM, 426: errno.EPERM, 427: errno.EPERM,  # io_uring_setup, _enter, _register
    175: errno.EPERM, 313: errno.EPERM, 176: errno.EPERM,  # init_module, finit_module, delete_module
    246: errno.EPERM, 320: errno.EPERM,  # kexec_load, kexec_file_load
    435: errno.ENOSYS,  # clone3: its flags sit in memory the filter cannot read; libc falls back to clone
}

# Classic BPF, as struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}, over struct seccomp_data
# {int nr; u32 arch; u64 ip; u64 args[6]} (little-endian: args[0]'s low word at offset 16).
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def _program() -> list[tuple[int, int, int, int]]:
    p = [(_LD_W_ABS, 0, 0, 4),  # arch
         (_JEQ, 1, 0, AUDIT_ARCH_X86_64), (_RET, 0, 0, _KILL_PROCESS),
         (_LD_W_ABS, 0, 0, 0),  # syscall number
         (_JGE, 0, 1, X32_SYSCALL_BIT), (_RET, 0, 0, _ERRNO | errno.EPERM)]
    for nr, err in DENIED.items():
        p += [(_JEQ, 0, 1, nr), (_RET, 0, 0, _ERRNO | err)]
    n = len(SOCKET_FAMILIES)
    for nr in (NR_SOCKET, NR_SOCKETPAIR):  # the family (args[0]) is one of SOCKET_FAMILIES, or refused
        p += [(_JEQ, 0, n + 3, nr), (_LD_W_ABS, 0, 0, 16)]
        p += [(_JEQ, n - k, 0, family) for k, family in enumerate(SOCKET_FAMILIES)]
        p += [(_RET, 0, 0, _ERRNO | errno.EAFNOSUPPORT), (_RET, 0, 0, _ALLOW)]
    p += [(_JEQ, 0, 3, NR_CLONE),
          (_LD_W_ABS, 0, 0, 16),  # clone's flags
          (_JSET, 0, 1, CLONE_NEW_FLAGS), (_RET, 0, 0, _ERRNO | errno.EPERM),
          (_RET, 0, 0, _ALLOW)]
    return p


def supported() -> bool:
    return platform.machine() == "x86_64"


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


# Built once at import, in the zygote, so a runner's install is a single prctl: building the ctypes
# objects (a CDLL and its function class) in every runner cost ~1 ms of CPU and copy-on-write faults.
_PROGRAM = b"".join(struct.pack("<HBBI", *ins) for ins in _program()) if supported() else b""
_BUF = ctypes.create_string_buffer(_PROGRAM, len(_PROGRAM))
_FPROG = _SockFprog(len(_PROGRAM) // 8, ctypes.cast(_BUF, ctypes.c_void_p))
_FPROG_ADDR = ctypes.addressof(_FPROG)


def install() -> None:
    """Filter this thread and everything it starts from now on (raises OSError if refused)."""
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, _FPROG_ADDR)
