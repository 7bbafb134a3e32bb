#!/usr/bin/env bash
# Runs a training command under numactl, bound to the CPUs and NUMA memory that belong to this
# process's local rank. Meant to sit between a launcher (torchrun, srun, mpirun) and the
# training command, so that each of the N processes on a host gets its own slice of the host:
#
#   torchrun --nproc_per_node 8 --no-python bash bind.sh --cpu=exclusive -- python -m dlrm.scripts.main ...
#
# See docs/bind.md for the modes. Exit status 2 means bind.sh itself refused to run (bad
# options, unknown local rank, numactl missing); anything else comes from the command.

set -euo pipefail

readonly PROG="${0##*/}"

# Associative arrays and ${!array[@]} on sparse arrays need bash 4.
if (( BASH_VERSINFO[0] < 4 )); then
    printf '%s: needs bash 4 or newer (this is %s)\n' "$PROG" "$BASH_VERSION" >&2
    exit 2
fi

usage() {
    cat <<EOF
Usage: $PROG [--cpu=MODE] [--mem=MODE] [--ib=MODE] [--dry-run] [--] COMMAND [ARGS...]

Runs COMMAND under numactl with CPU and memory binding chosen for this process's local rank,
read from LOCAL_RANK (torchrun), SLURM_LOCALID (srun) or OMPI_COMM_WORLD_LOCAL_RANK (mpirun),
and the number of processes on this host, read from LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE,
SLURM_TASKS_PER_NODE or OMPI_COMM_WORLD_LOCAL_SIZE.

  --cpu=MODE   exclusive        split the host's CPUs into equal contiguous shares, one per
                                local rank, keeping SMT siblings together (default)
               exclusive,nosmt  the same, but only the first hardware thread of each core
               node             every CPU of the rank's NUMA node
               FILE             line i of FILE is the CPU list of local rank i (e.g. 0-7,64-71),
                                or FILE is a mapping file in NVIDIA's form (below)
               off              no CPU binding
  --mem=MODE   node             allocate memory only on the rank's NUMA node (default)
               FILE             line i of FILE is the node list of local rank i (e.g. 0 or 0,1),
                                or FILE is a mapping file in NVIDIA's form (below)
               off              no memory binding
  --ib=MODE    single           point Open MPI and UCX at one InfiniBand device, the rank's
                                share of this host's devices (a note and no change where none)
               off              leave them alone (default)
  --dry-run    print the command that would run and exit 0 (also: BIND_DRY_RUN=1)
  -h, --help   show this text

A mapping file in NVIDIA's form (dgxa100_ccx.sh: a file named *.sh, or holding '=' or '#') sets
bash arrays indexed by local rank, and is read, not run:
  bind_cpu_cores=([0]="0-3,64-67" [1]="4-7,68-71")  # --cpu: numactl --physcpubind
  bind_cpu_nodes=([0]="1" [1]="1")   # --cpu without bind_cpu_cores: numactl --cpunodebind
  bind_mem=([0]="1" [1]="1")         # --mem: numactl --membind

--ib=single sets OMPI_MCA_btl_openib_if_include and UCX_NET_DEVICES (unless already set) to
device local_rank * devices / local_size of BIND_IB_DEVICES (names in GPU order, e.g.
"mlx5_0,mlx5_1") or else of /sys/class/infiniband; NCCL chooses its own (NCCL_IB_HCA).

The rank's NUMA node is node number local_rank * nodes / local_size (nodes in ascending order).
The topology comes from 'lscpu -p=CPU,CORE,SOCKET,NODE'. With --cpu=off --mem=off the command
runs directly, without numactl.

Example:
  torchrun --nproc_per_node 8 --no-python bash $PROG --cpu=exclusive -- python -m dlrm.scripts.main
EOF
}

die() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit 2
}

# Text from a file or the environment as an error message may show it: printable ASCII only
# (any other byte, a terminal escape included, becomes '?'), at most 60 characters.
shown() {
    local LC_ALL=C
    local text=${1//[^ -~]/?}
    (( ${#text} <= 60 )) || text="${text:0:60}..."
    printf '%s' "$text"
}

# Integers are decimal, at most 9 digits: bash arithmetic is 64-bit and wraps silently
# (18446744073709551615 is -1), so a longer number is refused rather than read.
readonly INT_RE='^[0-9]{1,9}$'

usage_error() {
    printf '%s: %s\n' "$PROG" "$*" >&2
    printf "Try '%s --help'.\n" "$PROG" >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

cpu_mode=exclusive
mem_mode=node
ib_mode=off
dry_run=0
case "${BIND_DRY_RUN:-0}" in
    ''|0|false|no) ;;
    *) dry_run=1 ;;
esac
cmd=()

# Checks a --cpu/--mem value and echoes it back; anything that is not a keyword must be a
# readable file, so that a typo in a mode name fails here instead of as a missing file later.
check_mode() {
    local option=$1 value=$2
    shift 2
    local keyword
    for keyword in "$@"; do
        if [[ $value == "$keyword" ]]; then
            printf '%s\n' "$value"
            return 0
        fi
    done
    [[ -n $value ]] || usage_error "$option needs a value"
    local IFS='|'
    [[ -f $value && -r $value ]] \
        || usage_error "$option: '$(shown "$value")' is neither a mode ($*) nor a readable file"
    printf '%s\n' "$value"
}

check_ib() {
    case $1 in
        single|off) printf '%s\n' "$1" ;;
        '') usage_error "--ib needs a value" ;;
        *) usage_error "--ib: '$1' is not a mode (single|off)" ;;
    esac
}

parse_args() {
    while (( $# > 0 )); do
        case $1 in
            -h|--help)
                usage
                exit 0
                ;;
            --dry-run)
                dry_run=1
                ;;
            --cpu=*)
                cpu_mode=$(check_mode --cpu "${1#*=}" exclusive exclusive,nosmt node off)
                ;;
            --mem=*)
                mem_mode=$(check_mode --mem "${1#*=}" node off)
                ;;
            --ib=*)
                ib_mode=$(check_ib "${1#*=}")
                ;;
            --cpu|--mem|--ib)
                (( $# >= 2 )) || usage_error "$1 needs a value"
                case $1 in
                    --cpu) cpu_mode=$(check_mode --cpu "$2" exclusive exclusive,nosmt node off) ;;
                    --mem) mem_mode=$(check_mode --mem "$2" node off) ;;
                    *) ib_mode=$(check_ib "$2") ;;
                esac
                shift
                ;;
            --)
                shift
                break
                ;;
            -*)
                usage_error "unknown option '$1'"
                ;;
            *)
                # The first word that is not an option starts the command, so '--' is optional
                # for commands that do not themselves begin with a dash.
                break
                ;;
        esac
        shift
    done
    (( $# > 0 )) || usage_error "no command given"
    cmd=("$@")
}

# ---------------------------------------------------------------------------------------------
# Local rank and local world size
# ---------------------------------------------------------------------------------------------

# Finds the first of the named variables that is set and non-empty and leaves its name in the
# global found_name (a global rather than output, so that callers can test the status with if).
found_name=''
first_set() {
    local name
    for name in "$@"; do
        if [[ -n ${!name:-} ]]; then
            found_name=$name
            return 0
        fi
    done
    found_name=''
    return 1
}

# Prints value $2 of variable $1 as a decimal integer, or stops with a message naming the
# variable. The 10# prefix keeps bash from reading '08' as a bad octal number.
read_int() {
    local name=$1 value=$2
    [[ $value =~ $INT_RE ]] || die "$name='$(shown "$value")' is not a non-negative integer of at most 9 digits"
    printf '%d\n' "$((10#$value))"
}

local_rank=''
local_size=''

detect_local_rank() {
    first_set LOCAL_RANK SLURM_LOCALID OMPI_COMM_WORLD_LOCAL_RANK \
        || die "cannot tell this process's local rank: none of LOCAL_RANK (torchrun)," \
               "SLURM_LOCALID (srun) or OMPI_COMM_WORLD_LOCAL_RANK (mpirun) is set." \
               "Start $PROG from one of those launchers, or set LOCAL_RANK yourself."
    local_rank=$(read_int "$found_name" "${!found_name}")
}

detect_local_size() {
    local value
    if first_set LOCAL_WORLD_SIZE SLURM_NTASKS_PER_NODE; then
        local_size=$(read_int "$found_name" "${!found_name}")
    elif [[ -n ${SLURM_TASKS_PER_NODE:-} ]]; then
        # SLURM writes this as e.g. '4(x2),3': 4 tasks on each of the first two nodes, 3 on
        # the third. Only the first count is used, as with a homogeneous allocation.
        value=${SLURM_TASKS_PER_NODE%%[!0-9]*}
        local_size=$(read_int SLURM_TASKS_PER_NODE "$value")
    elif first_set OMPI_COMM_WORLD_LOCAL_SIZE; then
        local_size=$(read_int "$found_name" "${!found_name}")
    else
        die "cannot tell how many processes run on this host: none of LOCAL_WORLD_SIZE" \
            "(torchrun), SLURM_NTASKS_PER_NODE/SLURM_TASKS_PER_NODE (srun) or" \
            "OMPI_COMM_WORLD_LOCAL_SIZE (mpirun) is set."
    fi
    (( local_size > 0 )) || die "the number of local processes must be positive, not $local_size"
    (( local_rank < local_size )) \
        || die "local rank $local_rank is not below the number of local processes ($local_size)"
}

# ---------------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------------

# Cores are keyed by (node, socket, core) packed into one integer. Bash lists the indices of a
# sparse indexed array in ascending order, so iterating over core_first gives the cores in
# node-major order without an external sort: consecutive cores, and so the contiguous shares
# of --cpu=exclusive, stay inside one NUMA node whenever the shares divide the nodes evenly.
readonly FIELD_BITS=20
readonly FIELD_MAX=$(( (1 << FIELD_BITS) - 1 ))
core_first=()     # core key -> lowest CPU number of that core (its first hardware thread)
cpu_core=()       # CPU number -> core key
cpu_node=()       # CPU number -> NUMA node
node_seen=()      # NUMA node -> 1

read_topology() {
    local output line cpu core socket node key
    command -v lscpu >/dev/null 2>&1 \
        || die "lscpu not found (package util-linux); it is needed for --cpu=exclusive/node and --mem=node"
    output=$(lscpu -p=CPU,CORE,SOCKET,NODE) || die "'lscpu -p=CPU,CORE,SOCKET,NODE' failed"
    while IFS= read -r line; do
        line=${line%$'\r'}
        [[ -z $line || $line == \#* ]] && continue
        IFS=, read -r cpu core socket node _ <<<"$line"
        [[ $cpu =~ $INT_RE ]] || die "unexpected line from lscpu: '$(shown "$line")'"
        # Empty fields mean lscpu has no information: no NUMA support counts as a single node
        # 0, an unknown core as a core of its own.
        [[ -n $core ]] || core=$cpu
        [[ -n $socket ]] || socket=0
        [[ -n $node ]] || node=0
        [[ $core =~ $INT_RE && $socket =~ $INT_RE && $node =~ $INT_RE ]] \
            || die "unexpected line from lscpu: '$(shown "$line")'"
        cpu=$((10#$cpu)) core=$((10#$core)) socket=$((10#$socket)) node=$((10#$node))
        (( core <= FIELD_MAX && socket <= FIELD_MAX && node <= FIELD_MAX )) \
            || die "lscpu numbers too large to handle: '$(shown "$line")'"
        key=$(( (node << (2 * FIELD_BITS)) | (socket << FIELD_BITS) | core ))
        if [[ -z ${core_first[key]:-} ]] || (( cpu < core_first[key] )); then
            core_first[key]=$cpu
        fi
        cpu_core[cpu]=$key
        cpu_node[cpu]=$node
        node_seen[node]=1
    done <<<"$output"
    (( ${#cpu_core[@]} > 0 )) || die "lscpu listed no CPUs"
}

# The NUMA node this rank is assigned to: ranks are spread evenly over the nodes in ascending
# order, so with 8 ranks on 2 nodes ranks 0-3 go to the first node and 4-7 to the second.
rank_node() {
    local nodes=("${!node_seen[@]}")
    printf '%s\n' "${nodes[local_rank * ${#nodes[@]} / local_size]}"
}

# Prints CPU (or node) numbers, given in ascending order, in numactl's compact list syntax.
compress_list() {
    local out='' start='' prev='' n
    for n in "$@"; do
        if [[ -n $prev ]] && (( n == prev + 1 )); then
            prev=$n
            continue
        fi
        [[ -z $start ]] || out+="$(range_text "$start" "$prev"),"
        start=$n
        prev=$n
    done
    [[ -z $start ]] || out+=$(range_text "$start" "$prev")
    printf '%s\n' "$out"
}

range_text() {
    if (( $1 == $2 )); then
        printf '%s' "$1"
    else
        printf '%s-%s' "$1" "$2"
    fi
}

# CPU list for --cpu=exclusive[,nosmt]: whole cores, cores_per_rank of them, taken in order.
exclusive_cpus() {
    local nosmt=$1
    local keys=("${!core_first[@]}")
    local ncores=${#keys[@]}
    local per_rank=$(( ncores / local_size ))
    (( per_rank > 0 )) \
        || die "--cpu=exclusive: $ncores cores cannot be shared among $local_size local processes;" \
               "use --cpu=node or --cpu=off"
    local chosen=() selected=() key cpu
    for key in "${keys[@]:local_rank * per_rank:per_rank}"; do
        chosen[key]=1
    done
    if (( nosmt )); then
        for key in "${!chosen[@]}"; do
            selected[core_first[key]]=1
        done
    else
        for cpu in "${!cpu_core[@]}"; do
            [[ -z ${chosen[cpu_core[cpu]]:-} ]] || selected[cpu]=1
        done
    fi
    compress_list "${!selected[@]}"
}

node_cpus() {
    local node=$1 selected=() cpu
    for cpu in "${!cpu_node[@]}"; do
        (( cpu_node[cpu] != node )) || selected[cpu]=1
    done
    compress_list "${!selected[@]}"
}

# Line local_rank (counting from 0) of a mapping file, trimmed of blanks.
file_line() {
    local option=$1 file=$2 lines=() line
    mapfile -t lines <"$file"
    (( local_rank < ${#lines[@]} )) \
        || die "$option: $file has ${#lines[@]} lines, none for local rank $local_rank"
    line=${lines[local_rank]%$'\r'}
    line=${line#"${line%%[![:space:]]*}"}
    line=${line%"${line##*[![:space:]]}"}
    [[ -n $line ]] || die "$option: line $((local_rank + 1)) of $file (local rank $local_rank) is empty"
    # numactl list syntax: numbers, ranges, commas, and its 'all', '!' and '+' forms. Anything
    # else (a second column, stray text) is a mistake in the file.
    [[ $line =~ ^[[:alnum:],!+-]+$ ]] \
        || die "$option: line $((local_rank + 1)) of $file is not a numactl list: '$(shown "$line")'"
    check_list_numbers "$option: line $((local_rank + 1)) of $file" "$line"
    printf '%s\n' "$line"
}

# Stops unless every number in numactl list $2 (CPU or node numbers) has at most 9 digits.
check_list_numbers() {
    local where=$1 rest=$2 number
    while [[ $rest =~ [0-9]+ ]]; do
        number=${BASH_REMATCH[0]}
        [[ $number =~ $INT_RE ]] || die "$where: a CPU or node number of ${#number} digits; at most 9 are read"
        rest=${rest#*"$number"}
    done
}

# Mapping files in NVIDIA's form (its dgxa100_ccx.sh, which NVIDIA's bind.sh sources): bash
# arrays indexed by local rank, any number of lines each, with comments:
#   bind_cpu_cores=([0]="0-3,64-67" [1]="4-7,68-71"   # numactl --physcpubind
#                   [2]="8-11,72-75")
#   bind_cpu_nodes=(0 0 1 1)                          # --cpunodebind, without bind_cpu_cores
#   bind_mem=([0]="0" [1]="0")                        # --membind
# The file is read here, not run, so that a mistake is named with its line. Elements follow
# bash: [i]=value sets index i, a bare value the index after the previous one; a value is
# quoted with "" or '' or bare, and must be a numactl list.
declare -A map_value=()   # "name/index" -> value, for the file last read
declare -A map_line=()    # name -> line of the file where its array starts
readonly MAP_NAMES='bind_cpu_cores, bind_cpu_nodes, bind_mem'

# Whether $1 is a mapping file in NVIDIA's form rather than one list per line: named *.sh as
# NVIDIA's bind.sh requires, or holding what a list file cannot ('=' or a '#' comment).
is_nvidia_map() {
    [[ $1 == *.sh ]] && return 0
    local content
    content=$(<"$1")
    [[ $content == *[=#]* ]]
}

read_nvidia_map() {
    local option=$1 file=$2
    local lines=() line rest name='' start=0 index=0 value n=0 key
    local re_open='^(declare[[:space:]]+-[aA]+[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=\('
    local re_index='^\[([0-9]{1,9})\]='
    local re_double='^"([^"]*)"'
    local re_single="^'([^']*)'"
    local re_bare='^([[:alnum:],!+-]+)'
    local re_end='^[[:space:])]'
    local where
    map_value=()
    map_line=()
    mapfile -t lines <"$file"
    for line in "${lines[@]}"; do
        n=$(( n + 1 ))
        where="$option: $file line $n"
        rest=${line%$'\r'}
        while :; do
            rest=${rest#"${rest%%[![:space:]]*}"}
            [[ -z $rest || $rest == \#* ]] && break
            if [[ -z $name ]]; then
                [[ $rest =~ $re_open ]] \
                    || die "$where: '$(shown "$rest")' is not an array such as" \
                           "bind_cpu_cores=([0]=\"0-7\" [1]=\"8-15\")" \
                           "(a file of one list per line is not named *.sh and has no '=' or '#')"
                name=${BASH_REMATCH[2]}
                case $name in
                    bind_cpu_cores|bind_cpu_nodes|bind_mem) ;;
                    *) die "$where: $name is none of the arrays read here ($MAP_NAMES)" ;;
                esac
                for key in "${!map_value[@]}"; do  # bash replaces an array assigned again
                    [[ $key != "$name/"* ]] || unset "map_value[$key]"
                done
                map_line[$name]=$n
                start=$n
                index=0
                rest=${rest:${#BASH_REMATCH[0]}}
                continue
            fi
            if [[ $rest == ')'* ]]; then
                name=''
                rest=${rest:1}
                continue
            fi
            if [[ $rest =~ $re_index ]]; then
                index=$(( 10#${BASH_REMATCH[1]} ))
                rest=${rest:${#BASH_REMATCH[0]}}
            fi
            if [[ $rest =~ $re_double || $rest =~ $re_single || $rest =~ $re_bare ]]; then
                value=${BASH_REMATCH[1]}
                rest=${rest:${#BASH_REMATCH[0]}}
            else
                die "$where: cannot read '$(shown "$rest")' in $name: write [i]=\"LIST\" or LIST, e.g. [0]=\"0-7\""
            fi
            [[ -z $rest || $rest =~ $re_end ]] \
                || die "$where: '$(shown "$value")' runs into '$(shown "$rest")' in $name: separate the elements" \
                       "with blanks"
            [[ $value =~ ^[[:alnum:],!+-]+$ ]] \
                || die "$where: '$(shown "$value")' in $name is not a numactl list (e.g. 0-7,64-71 or 3)"
            check_list_numbers "$where: $name" "$value"
            map_value[$name/$index]=$value
            index=$(( index + 1 ))
        done
    done
    [[ -z $name ]] || die "$option: $file line $start: the array $name=( is not closed with ')'"
}

# The numactl option for this rank from mapping file $2 in NVIDIA's form: for --cpu
# bind_cpu_cores, else bind_cpu_nodes; for --mem bind_mem.
nvidia_map_arg() {
    local option=$1 file=$2 name numactl_option
    read_nvidia_map "$option" "$file"
    if [[ $option == --mem ]]; then
        name=bind_mem numactl_option=--membind
    elif [[ -n ${map_line[bind_cpu_cores]:-} ]]; then
        name=bind_cpu_cores numactl_option=--physcpubind
    else
        name=bind_cpu_nodes numactl_option=--cpunodebind
    fi
    if [[ -z ${map_line[$name]:-} ]]; then
        [[ $option == --mem ]] && die "$option: $file sets no bind_mem array (e.g. bind_mem=([0]=\"0\" [1]=\"1\"))"
        die "$option: $file sets neither bind_cpu_cores nor bind_cpu_nodes (e.g. bind_cpu_cores=([0]=\"0-7\"))"
    fi
    [[ -n ${map_value[$name/$local_rank]:-} ]] \
        || die "$option: $file line ${map_line[$name]}: $name has no entry for local rank $local_rank"
    printf '%s=%s\n' "$numactl_option" "${map_value[$name/$local_rank]}"
}

# A --cpu or --mem FILE: its numactl option for this rank, in either form.
file_arg() {
    local option=$1 file=$2 list
    if is_nvidia_map "$file"; then
        nvidia_map_arg "$option" "$file"
        return
    fi
    list=$(file_line "$option" "$file") || exit  # a subshell of a subshell: errexit is not inherited
    if [[ $option == --cpu ]]; then
        printf -- '--physcpubind=%s\n' "$list"
    else
        printf -- '--membind=%s\n' "$list"
    fi
}

# ---------------------------------------------------------------------------------------------
# InfiniBand
# ---------------------------------------------------------------------------------------------

# --ib=single as NVIDIA's bind.sh means it: the rank's share of this host's InfiniBand devices
# (device local_rank * devices / local_size) for Open MPI's openib transport and UCX, unless
# the environment already names one. The devices are BIND_IB_DEVICES (names, in the order that
# follows the GPUs) or those in /sys/class/infiniband, in version order. Sets ib_env to the
# assignments made.
ib_env=()
bind_ib() {
    local devices=() device chosen var value
    if [[ -n ${BIND_IB_DEVICES:-} ]]; then
        read -r -a devices <<<"${BIND_IB_DEVICES//,/ }"
        for device in "${devices[@]}"; do
            [[ $device =~ ^[A-Za-z0-9_.:-]+$ ]] \
                || die "BIND_IB_DEVICES: '$(shown "$device")' is not a device name (e.g. mlx5_0)"
        done
    elif [[ -d /sys/class/infiniband ]]; then
        local names=()
        for device in /sys/class/infiniband/*; do
            [[ -e $device ]] && names+=("${device##*/}")
        done
        # in version order, as NVIDIA's scripts list them ('ibstat -l | sort -V'): mlx5_2 before mlx5_10
        (( ${#names[@]} == 0 )) || mapfile -t devices < <(printf '%s\n' "${names[@]}" | sort -V)
    fi
    if (( ${#devices[@]} == 0 )); then
        printf '%s: --ib=single: this host has no InfiniBand device (/sys/class/infiniband); running without one\n' \
            "$PROG" >&2
        return 0
    fi
    chosen=${devices[local_rank * ${#devices[@]} / local_size]}
    for var in OMPI_MCA_btl_openib_if_include UCX_NET_DEVICES; do
        [[ -z ${!var+set} ]] || continue  # the user's own choice stays
        value=$chosen
        [[ $var == UCX_NET_DEVICES ]] && value=$chosen:1
        export "$var=$value"
        ib_env+=("$var=$value")
    done
}

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

# Prints the command line for --dry-run: the numactl part as it is (it holds only list
# characters), the user's command quoted with printf %q so it can be pasted back into a shell.
print_command() {
    local prefix_count=$1
    shift
    local words=("${@:1:prefix_count}") rest=("${@:prefix_count + 1}") quoted
    if (( ${#rest[@]} > 0 )); then
        quoted=$(printf '%q ' "${rest[@]}")
        words+=("${quoted% }")
    fi
    local IFS=' '
    printf '%s\n' "${words[*]}"
}

main() {
    parse_args "$@"

    local binding=1
    [[ $cpu_mode == off && $mem_mode == off ]] && binding=0

    # Fail on a missing numactl before anything else: it is the one problem that every rank
    # on every host would hit, and the fix is the same for all of them.
    if (( binding && ! dry_run )) && ! command -v numactl >/dev/null 2>&1; then
        die "numactl not found. Install it (e.g. 'apt-get install numactl' or" \
            "'yum install numactl'), or run without binding: --cpu=off --mem=off"
    fi

    local numa_args=()
    if [[ $ib_mode == single ]]; then
        detect_local_rank
        detect_local_size
        bind_ib
    fi
    if (( binding )); then
        [[ -n $local_rank ]] || detect_local_rank
        case $cpu_mode in exclusive*|node) [[ -n $local_size ]] || detect_local_size ;; esac
        case $mem_mode in node) [[ -n $local_size ]] || detect_local_size ;; esac
        case $cpu_mode in exclusive*|node) read_topology ;; esac
        case $mem_mode in node) (( ${#cpu_core[@]} > 0 )) || read_topology ;; esac

        # Each list goes through a variable first: a failure inside $(...) stops the script
        # only when the substitution is the whole of a plain assignment.
        local cpus='' mems='' node=''
        [[ ${#node_seen[@]} -eq 0 ]] || node=$(rank_node)
        case $cpu_mode in
            off) ;;
            exclusive) cpus=--physcpubind=$(exclusive_cpus 0) ;;
            exclusive,nosmt) cpus=--physcpubind=$(exclusive_cpus 1) ;;
            node) cpus=--physcpubind=$(node_cpus "$node") ;;
            *) cpus=$(file_arg --cpu "$cpu_mode") ;;
        esac
        case $mem_mode in
            off) ;;
            node) mems=--membind=$node ;;
            *) mems=$(file_arg --mem "$mem_mode") ;;
        esac
        [[ -z $cpus ]] || numa_args+=("$cpus")
        [[ -z $mems ]] || numa_args+=("$mems")
    fi

    if (( dry_run )); then
        # the variables --ib sets come first, as a shell would take them for this one command
        if (( binding )); then
            print_command $(( ${#ib_env[@]} + ${#numa_args[@]} + 2 )) "${ib_env[@]}" numactl "${numa_args[@]}" -- \
                "${cmd[@]}"
        else
            print_command ${#ib_env[@]} "${ib_env[@]}" "${cmd[@]}"
        fi
        exit 0
    fi

    if (( binding )); then
        exec numactl "${numa_args[@]}" -- "${cmd[@]}"
    fi
    exec "${cmd[@]}"
}

main "$@"
