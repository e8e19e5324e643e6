#!/usr/bin/env python3
"""Compares the machine code (SASS) of every kernel in two builds' object files, without
cuobjdump: e.g. bench/sass_cmp.py build-old/CMakeFiles build-cuda/CMakeFiles [-v].

Each .o built by nvcc embeds its cubin (an ELF) in .nv_fatbin; a kernel's SASS is the
section .text.<mangled name>. The script extracts the cubins, reads per kernel: the
.text bytes (the SASS itself, byte for byte), the register count and spill frame
(EIATTR_REGCOUNT, EIATTR_FRAME_SIZE of .nv.info), the static shared memory
(.nv.shared.<name> size) and the parameter bank (.nv.constant0.<name> size), keys kernels by demangled name with the
helper types normalised (the views moved namespace), and reports differences.
usage: sass_cmp.py BASE_OBJ_DIR NEW_OBJ_DIR [-v]  (exit status 1 when a kernel differs)
"""
import os, re, struct, subprocess, sys, hashlib

def cubins(blob):
    out, pos = [], 0
    while True:
        i = blob.find(b'\x7fELF', pos)
        if i < 0: return out
        pos = i + 4
        if i == 0: continue
        if blob[i+4] != 2: continue  # ELF64 only
        e_shoff, = struct.unpack_from('<Q', blob, i + 0x28)
        e_shentsize, e_shnum, e_shstrndx = struct.unpack_from('<HHH', blob, i + 0x3A)
        e_machine, = struct.unpack_from('<H', blob, i + 0x12)
        if e_machine != 190: continue  # EM_CUDA
        end = i + e_shoff + e_shentsize * e_shnum
        out.append(blob[i:end]); pos = end

def sections(elf):
    e_shoff, = struct.unpack_from('<Q', elf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from('<HHH', elf, 0x3A)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', elf, e_shoff + k * e_shentsize) for k in range(e_shnum)]
    stro = hdrs[e_shstrndx][4]
    def name(off):
        j = elf.index(b'\0', stro + off); return elf[stro + off:j].decode()
    res = {}
    # symbol index -> name, and the per-symbol attributes of the global .nv.info
    symtab = strtab = None
    for h in hdrs:
        if h[1] == 2: symtab = h
    names = [name(h[0]) for h in hdrs]
    strtab = hdrs[names.index('.strtab')]
    syms = []
    for k in range(symtab[5] // 24):
        st_name, = struct.unpack_from('<I', elf, symtab[4] + 24 * k)
        j = elf.index(b'\0', strtab[4] + st_name); syms.append(elf[strtab[4] + st_name:j].decode())
    attrs = {}
    info = hdrs[names.index('.nv.info')] if '.nv.info' in names else None
    if info:
        o, e = info[4], info[4] + info[5]
        while o < e:
            fmt, attr = elf[o], elf[o + 1]; o += 2
            if fmt == 4:
                sz, = struct.unpack_from('<H', elf, o); o += 2
                if sz == 8 and attr in (0x2f, 0x11, 0x23):  # REGCOUNT, FRAME_SIZE, MAX_STACK_SIZE
                    idx, val = struct.unpack_from('<II', elf, o)
                    attrs.setdefault(syms[idx], {})[{0x2f: 'regs', 0x11: 'frame', 0x23: 'stack'}[attr]] = val
                o += sz
            elif fmt == 3: o += 2
            elif fmt == 2: o += 1
    res['__attrs__'] = attrs
    for h in hdrs:
        nm, typ, flags, addr, off, size, link, info, align, entsz = h
        data = elf[off:off + size] if typ != 8 else b''  # NOBITS
        res[name(nm)] = (size, info, data)
    return res

def demangle(names):
    p = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True)
    return p.stdout.split('\n')[:len(names)]

NORM = [
    (r'gdncp::cuda::detail::InView<true>', 'In'), (r'gdncp::cuda::detail::InView<false>', 'InPlain'),
    (r'gdncp::cp::cuda::dev::In\b', 'InPlain'), (r'gdncp::cuda::detail::In\b', 'In'),
    (r'gdncp::cp::cuda::dev::Out\b', 'Out'), (r'gdncp::cuda::detail::Out\b', 'Out'),
]
def norm(s):
    for a, b in NORM: s = re.sub(a, b, s)
    return s

def kernels(objdir):
    ks = {}
    for root, _, files in os.walk(objdir):
        for f in sorted(files):
            if not f.endswith('.cu.o'): continue
            blob = open(os.path.join(root, f), 'rb').read()
            for elf in cubins(blob):
                secs = sections(elf)
                attrs = secs.pop('__attrs__')
                mangled = [n[len('.text.'):] for n in secs if n.startswith('.text.')]
                for m, d in zip(mangled, demangle(mangled)):
                    size, info, text = secs['.text.' + m]
                    sh = secs.get('.nv.shared.' + m, (0, 0, b''))[0]
                    c0 = secs.get('.nv.constant0.' + m, (0, 0, b''))[0]
                    a = attrs.get(m, {})
                    ks[norm(d)] = dict(file=f, regs=a.get('regs', -1), frame=a.get('frame', -1), smem=sh, params=c0, bytes=size,
                                       sha=hashlib.sha1(text).hexdigest()[:12], text=text)
    return ks

base, new = kernels(sys.argv[1]), kernels(sys.argv[2])
same = diff = 0
for k in sorted(set(base) | set(new)):
    b, n = base.get(k), new.get(k)
    if not b or not n:
        print(('ONLY-BASE ' if b else 'ONLY-NEW  ') + k); diff += 1; continue
    if b['text'] == n['text'] and (b['regs'], b['smem'], b['frame']) == (n['regs'], n['smem'], n['frame']):
        same += 1
        if '-v' in sys.argv: print('same  %s  regs %d spill-frame %d smem %d sass %dB  %s' % (n['file'], n['regs'], n['frame'], n['smem'], n['bytes'], k))
    else:
        diff += 1
        print('DIFF  %s -> %s  regs %d->%d frame %d->%d smem %d->%d params %d->%d sass %dB->%dB  %s' % (
            b['file'], n['file'], b['regs'], n['regs'], b['frame'], n['frame'], b['smem'], n['smem'], b['params'], n['params'], b['bytes'], n['bytes'], k))
print('%d kernels identical (SASS bytes, registers, spill frame, static shared memory), %d differ' % (same, diff))
sys.exit(1 if diff else 0)
